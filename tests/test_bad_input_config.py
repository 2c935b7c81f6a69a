"""Bad input gets ONE clear ``MineOnlineError`` before Ray starts or data is touched: config values,
types and keys, the generators of a config module, the command line.

Each case asserts the message names the key (or file) and the offending value, so a user can fix
it from the message alone. Nothing here starts Ray. ``test_bad_input_storage.py`` (checkpoints, paths,
full disks) and ``test_bad_input_sizes.py`` (what does not fit the machine) share ``BASE``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mineonline_core.config import LoadedConfig, check_resources, load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError, UnknownComponentError
from mineonline_core.registry import get_plugin_manager
from tests.conftest import cartpole_config

ROOT = Path(__file__).resolve().parents[1]
BASE = cartpole_config(run_name="bad-input")


@pytest.fixture(autouse=True)
def _no_ray_started():
    yield
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a bad-input path started Ray"


# -- config values, types and keys ----------------------------------------------------------------

CASES = [
    ("train_config.learning_rate=-1e-4", "train_config.learning_rate", "-0.0001", "> 0"),
    ("train_config.ppo_clip=0", "train_config.ppo_clip", "0", "> 0"),
    ("train_config.ppo_clip=-0.2", "train_config.ppo_clip", "-0.2", "> 0"),
    ("train_config.gae_lambda=1.5", "train_config.gae_lambda", "1.5", "<= 1"),
    ("rollout_config.fragment_length=0", "rollout_config.fragment_length", "0", ">= 1"),
    ("train_config.num_iterations=many", "train_config.num_iterations", "'many'", "integer"),
    ("rollout_config.worker_config.num_envs=[2]", "rollout_config.worker_config.num_envs", "[2]", "integer"),
    ("train_config.learning_rat=1e-4", "train_config.learning_rat", "0.0001", "learning_rate"),
    ("rollout_config.replay_buffer_config.max_chunk=10", "replay_buffer_config.max_chunk", "10", "max_chunks"),
]


@pytest.mark.parametrize(("override", "key", "value", "hint"), CASES, ids=[c[0] for c in CASES])
def test_config_mistakes_name_key_and_value(override: str, key: str, value: str, hint: str) -> None:
    # The trainer's own train_config keys (ppo_clip; a typo is one of them) are checked by resolve(),
    # against the selected trainer's Config, before the env or the policy is built.
    with pytest.raises(ConfigError) as info:
        resolve(load_config(BASE, [override]), get_plugin_manager(), probe=False)
    message = str(info.value)
    assert key in message and value in message and hint in message, message
    assert "1 problem" in message  # one clear message, not a cascade
    assert "Traceback" not in message


def test_run_rejects_a_bad_value_before_ray_starts(tmp_path: Path) -> None:
    from mineonline_core.driver.api import run

    with pytest.raises(ConfigError, match=r"train_config\.ppo_clip"):
        run(BASE, ["train_config.ppo_clip=0", f"output_dir={tmp_path}"], progress=False)
    assert not (tmp_path / "bad-input").exists()  # no run directory either


def test_impossible_resources() -> None:
    cfg = load_config(BASE, ["rollout_config.num_rollout_workers=4", "rollout_config.num_cpus_per_worker=2"]).config
    with pytest.raises(ConfigError) as info:
        check_resources(cfg, {"CPU": 2.0})
    message = str(info.value)
    assert "CPUs" in message and "rollout_config.num_rollout_workers 4" in message and "has 2" in message
    gpu = load_config(BASE, ["train_config.num_gpus_per_worker=1"]).config
    with pytest.raises(ConfigError, match=r"GPUs.*train_config.num_gpus_per_worker 1.*has 0"):
        check_resources(gpu, {"CPU": 64.0})
    check_resources(cfg, {"CPU": 64.0})  # enough: no error


# -- generators -----------------------------------------------------------------------------------


def _loaded(**generators) -> LoadedConfig:
    data = {k: v for k, v in BASE.items() if k not in ("env_config", "policy_config")}
    loaded = load_config(data)
    loaded.env_generator = generators.get("env_generator", _cartpole)
    loaded.policy_generator = generators.get("policy_generator", _policy)
    return loaded


def _cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _policy():
    from mineonline_core.testing.kit import TinyMLPPolicy

    return TinyMLPPolicy(obs_dim=4, n_actions=2)


def test_unserialisable_policy_generator() -> None:
    lock = threading.Lock()

    def policy_generator():
        with lock:
            return _policy()

    with pytest.raises(ConfigError) as info:
        resolve(_loaded(policy_generator=policy_generator), get_plugin_manager())
    assert "policy_generator cannot be serialised" in str(info.value) and "lock" in str(info.value)


def test_unserialisable_env_generator() -> None:
    lock = threading.Lock()
    with pytest.raises(ConfigError, match=r"env_generator cannot be serialised.*lock"):
        resolve(_loaded(env_generator=lambda: (lock, _cartpole())[1]), get_plugin_manager())


def test_generators_that_raise() -> None:
    def broken_env():
        raise FileNotFoundError("no such simulator: /opt/minecraft")

    def broken_policy():
        raise KeyError("pi_head.weight")

    with pytest.raises(ConfigError, match=r"env_generator\(\) raised FileNotFoundError: no such simulator"):
        resolve(_loaded(env_generator=broken_env), get_plugin_manager())
    with pytest.raises(ConfigError, match=r"policy_generator\(\) raised KeyError: 'pi_head.weight'"):
        resolve(_loaded(policy_generator=broken_policy), get_plugin_manager())


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_unknown_trainer_name(tmp_path: Path) -> None:
    config = ROOT / "examples" / "cartpole.yaml"
    if not config.exists():
        import yaml

        config = tmp_path / "cartpole.yaml"
        config.write_text(yaml.safe_dump(BASE))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "check", str(config), "trainer_name=PPOTrainr"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "PPOTrainr" in result.stderr and "PPOTrainer" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_stop_with_a_negative_grace_names_the_option_and_starts_nothing(capsys) -> None:
    from mineonline_core.cli import main

    assert main(["stop", "some-run", "--grace", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--grace=-5.0" in err and "Fix:" in err


def test_unknown_component_names_list_the_choices() -> None:
    for override, wanted in (
        ("rollout_config.replay_buffer_config.database_config.backend=lmbd", "lmdb"),
        ("logger_config.loggers=[wandbb]", "wandb"),
    ):
        with pytest.raises(UnknownComponentError) as info:
            resolve(load_config(BASE, [override]), get_plugin_manager())
        assert wanted in str(info.value)
