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
    from mineonline_core.runtime.resolve import resolve

    plugin_manager = get_plugin_manager()

    config = {"env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp"},
              "logger_config": {"loggers": ["tensorboard"], "tensorboard_dir": "/tmp/tb"}}  # fmt: skip
    resolved = resolve(load_config(config), plugin_manager, probe=False)
    (cls, _), (tb, options) = resolved.loggers
    assert tb is mineonline_tensorboard.TensorBoardLogger and options.tensorboard_dir == "/tmp/tb"
    origin = [o for name, _, o in plugin_manager.registries["logger"].items() if name == "tensorboard"]
    assert origin and origin[0].distribution == "mineonline-tensorboard-logger"
