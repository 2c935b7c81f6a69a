"""The TensorBoard logger against the core's logger conformance suite, read back with TensorBoard's own reader."""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import mineonline_tensorboard
except ImportError:  # the plugin is not pip-installed: import it from its source folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mineonline_tensorboard

from mineonline_core.testing.logger_conformance import LoggerConformance, Scalars


def read_events(log_dir: Path) -> Scalars:
    """Scalars as TensorBoard shows them (its event accumulator applies purge steps)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class TestTensorBoardLogger(LoggerConformance):
    logger_cls = mineonline_tensorboard.TensorBoardLogger

    def read_scalars(self, run_dir: Path) -> Scalars:
        return read_events(run_dir / "tensorboard")


def test_selected_by_name_with_its_own_keys() -> None:
    from mineonline_core.config import load_config
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    plugin_manager = get_plugin_manager()

    config = {
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp"},
        "logger_config": {"loggers": ["tensorboard"], "tensorboard_dir": "/tmp/tb"},
    }
    resolved = resolve(load_config(config), plugin_manager, probe=False)
    (cls, _), (tb, options) = resolved.loggers
    assert tb is mineonline_tensorboard.TensorBoardLogger and options.tensorboard_dir == "/tmp/tb"
    origin = [o for name, _, o in plugin_manager.registries["logger"].items() if name == "tensorboard"]
    assert origin and origin[0].distribution == "mineonline-tensorboard-logger"


def test_config_recorded_as_text_and_hparams(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from mineonline_core.config import load_config
    from mineonline_core.config.secrets import public_config

    root = Path(__file__).resolve().parents[3]
    config = public_config(
        load_config(str(root / "examples" / "cartpole.yaml"), ["train_config.learning_rate=3e-4"]).config
    )
    logger = mineonline_tensorboard.TensorBoardLogger(run_dir=str(tmp_path), config=config)
    logger.log_metrics({"episode/return_mean": 12.0}, step=256)
    logger.finish()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("config/text_summary")
    yaml_text = text.tensor_proto.string_val[0].decode()
    assert "    learning_rate: 0.0003" in yaml_text and "    trainer_name: PPOTrainer" in yaml_text

    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    hparams = {
        key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind"))
        for key, value in start.hparams.items()
    }
    assert hparams["train_config.learning_rate"] == 3e-4 and hparams["trainer_name"] == "PPOTrainer"
    assert hparams["policy_config.hidden_sizes"] == "[64, 64]" and hparams["rollout_config.worker_config.num_envs"] == 4
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["episode/return_mean"]
    assert events.Scalars("episode/return_mean")[0].value == 12.0
