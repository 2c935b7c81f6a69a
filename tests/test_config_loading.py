"""Loading a config: MineStudio's online_dict and modules, YAML, OmegaConf, overrides, round trips (fast, no Ray).

The MineStudio examples and the error helpers here are shared with ``test_config_errors.py`` and
``test_config_reference.py``.
"""

from __future__ import annotations

import copy
import pickle
import re
import subprocess
import sys
import textwrap
import types

import cloudpickle
import pytest
import yaml
from omegaconf import OmegaConf

import mineonline_core
from mineonline_core.config import LoadedConfig, OnlineConfig, load_config, validate_online_config
from mineonline_core.errors import ConfigError

# MineStudio's documented online_dict (docs/source/online/config.md), every key, verbatim values.
MINESTUDIO_EXAMPLE = {
    "trainer_name": "PPOTrainer",
    "detach_rollout_manager": True,
    "rollout_config": {
        "num_rollout_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_cpus_per_worker": 1,
        "fragment_length": 256,
        "to_send_queue_size": 1,
        "worker_config": {
            "num_envs": 2,
            "batch_size": 1,
            "restart_interval": 3600,
            "video_fps": 20,
            "video_output_dir": "output/videos",
        },
        "replay_buffer_config": {
            "max_chunks": 4800,
            "max_reuse": 2,
            "max_staleness": 2,
            "fragments_per_report": 40,
            "fragments_per_chunk": 1,
            "database_config": {"path": "output/replay_buffer_cache", "num_shards": 8},
        },
        "episode_statistics_config": {},
    },
    "train_config": {
        "num_workers": 2,
        "num_gpus_per_worker": 1.0,
        "num_iterations": 4000,
        "vf_warmup": 0,
        "learning_rate": 0.00002,
        "anneal_lr_linearly": False,
        "weight_decay": 0.04,
        "adam_eps": 1e-8,
        "batch_size_per_gpu": 1,
        "batches_per_iteration": 10,
        "gradient_accumulation": 10,
        "epochs_per_iteration": 1,
        "context_length": 64,
        "discount": 0.999,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "clip_vloss": False,
        "max_grad_norm": 5,
        "zero_initial_vf": True,
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,
        "kl_divergence_coef_rho": 0.0,
        "entropy_bonus_coef": 0.0,
        "coef_rho_decay": 0.9995,
        "log_ratio_range": 50,
        "normalize_advantage_full_batch": True,
        "use_normalized_vf": True,
        "num_readers": 4,
        "num_cpus_per_reader": 0.1,
        "prefetch_batches": 2,
        "save_interval": 10,
        "keep_interval": 40,
        "record_video_interval": 2,
        "enable_ref_update": False,
        "fix_decoder": False,
        "resume": None,
        "resume_optimizer": True,
        "save_path": "/scratch/hekaichen/workspace/MineStudio/minestudio/online/run/output",
        "use_amp": False,
    },
    "logger_config": {"project": "minestudio_online", "name": "bow_cow"},
}

# The gate_kl-style cow example of MineStudio's quick start (KL towards the pretrained policy).
GATE_KL_EXAMPLE = copy.deepcopy(MINESTUDIO_EXAMPLE)
GATE_KL_EXAMPLE["rollout_config"]["to_send_queue_size"] = 6
GATE_KL_EXAMPLE["rollout_config"]["worker_config"].update(num_envs=12, batch_size=6)
GATE_KL_EXAMPLE["train_config"].update(batches_per_iteration=200, kl_divergence_coef_rho=0.2, save_path="output")


def _leaves(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _error(data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data, overrides)
    return str(info.value)


def _trainer_error(data: dict, overrides=()) -> str:
    """The error ``resolve()`` raises for the selected trainer's own train_config keys (its first check)."""
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    with pytest.raises(ConfigError) as info:
        resolve(load_config(data, overrides), get_plugin_manager(), probe=False)
    return str(info.value)


# --- MineStudio compatibility ---------------------------------------------------------------


@pytest.mark.parametrize("example", [MINESTUDIO_EXAMPLE, GATE_KL_EXAMPLE], ids=["docs", "gate_kl"])
def test_minestudio_online_dict_validates_unchanged(example):
    original = copy.deepcopy(example)
    loaded = load_config(example)
    assert example == original  # the caller's dict is not modified
    dumped = loaded.config.to_dict()
    for path, value in _leaves(example):
        if value != {}:  # an empty section ({}) is filled with that section's defaults
            assert _get(dumped, path) == value, path
    assert loaded.config.train_config.use_amp is False
    assert loaded.config.run_name == "bow_cow"  # MineStudio's logger name names the run
    assert loaded.config.rollout_config.replay_buffer_config.database_config.backend == "lmdb"
    assert loaded.env_generator is None and loaded.source_path is None


def test_minestudio_python_module_with_generators(tmp_path):
    module_file = tmp_path / "cow_config.py"
    module_file.write_text(
        textwrap.dedent(
            f"""
            from omegaconf import OmegaConf

            def policy_generator():
                return "policy"

            def env_generator():
                return "env"

            online_dict = {MINESTUDIO_EXAMPLE!r}
            online_config = OmegaConf.create(online_dict)
            """
        )
    )
    loaded = load_config(str(module_file), ["train_config.learning_rate=3e-4"])
    assert isinstance(loaded, LoadedConfig)
    assert loaded.env_generator() == "env" and loaded.policy_generator() == "policy"
    assert loaded.source_text == module_file.read_text()
    assert loaded.source_path == str(module_file)
    assert loaded.config.train_config.learning_rate == pytest.approx(3e-4)
    assert loaded.config.rollout_config.num_rollout_workers == 2
    # Loading twice executes the module twice under distinct names (edits are picked up).
    assert load_config(module_file).env_generator is not loaded.env_generator


def test_module_generators_pickle_by_value_for_ray_workers(tmp_path):
    module_file = tmp_path / "gen_config.py"
    module_file.write_text("FACTOR = 7\n\ndef env_generator():\n    return FACTOR * 6\n\nonline_dict = {}\n")
    payload = cloudpickle.dumps(load_config(module_file).env_generator)
    # A fresh interpreter cannot import the user's file; the function must travel by value.
    script = "import pickle, sys; print(pickle.loads(sys.stdin.buffer.read())())"
    result = subprocess.run([sys.executable, "-c", script], input=payload, capture_output=True, check=True, cwd="/")
    assert result.stdout.strip() == b"42"


def test_module_object_and_module_errors(tmp_path):
    module = types.ModuleType("inline_config")
    module.online_dict = OmegaConf.create({"seed": 3})
    module.env_generator = lambda: "env"
    loaded = load_config(module)
    assert loaded.config.seed == 3 and loaded.env_generator() == "env"

    no_dict = tmp_path / "no_dict.py"
    no_dict.write_text("x = 1\n")
    assert "defines no 'online_dict'" in _error(no_dict)
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    message = _error(broken)
    assert "RuntimeError: boom" in message and "Fix:" in message
    not_callable = tmp_path / "not_callable.py"
    not_callable.write_text("online_dict = {}\nenv_generator = 5\n")
    assert "env_generator is 5 (int), not a function" in _error(not_callable)


# --- overrides, sources, round trips --------------------------------------------------------


def test_overrides_valid_unknown_and_wrong_type():
    overrides = [
        "train_config.learning_rate=1e-4",
        "logger_config.loggers=[]",
        "train_config.resume=null",
        "rollout_config.worker_config.num_envs=8",
    ]
    cfg = load_config(MINESTUDIO_EXAMPLE, overrides).config
    assert cfg.train_config.learning_rate == pytest.approx(1e-4)
    assert cfg.logger_config.loggers == [] and cfg.train_config.resume is None
    assert cfg.rollout_config.worker_config.num_envs == 8
    assert cfg.rollout_config.worker_config.batch_size == 1  # siblings survive the merge

    message = _trainer_error({}, ["train_config.learning_rat=1"])
    assert "Did you mean 'learning_rate'?" in message
    assert "override 'train_config.learning_rat=1'" in message
    assert "override 'train_config.ppo_clip=0'" in _trainer_error({}, ["train_config.ppo_clip=0"])
    message = _error({}, ["rollout_config.worker_config.num_envs=abc"])
    assert "num_envs: must be an integer, got 'abc'" in message and "override" in message
    assert "not of the form key.path=value" in _error({}, ["oops"])
    assert "cannot be parsed" in _error({}, ["train_config.learning_rate=[1"])


def test_yaml_file_and_its_errors(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: 5\ntrain_config:\n  learning_rate: 1e-4\n  save_interval: 5\n"
        "  keep_interval: ${train_config.save_interval}\n"
    )
    loaded = load_config(path)
    assert loaded.config.seed == 5 and loaded.config.train_config.learning_rate == 1e-4
    assert loaded.config.train_config.keep_interval == 5  # OmegaConf interpolation
    assert loaded.source_text == path.read_text() and loaded.source_path == str(path)
    empty_section = tmp_path / "empty_section.yaml"
    empty_section.write_text("rollout_config:\n  episode_statistics_config:\n")
    assert load_config(empty_section).config.rollout_config.episode_statistics_config.window == 100

    bad = tmp_path / "bad.yml"
    bad.write_text("train_config: [1, 2\n")
    assert "is not valid YAML" in _error(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert "must be a mapping" in _error(listing)
    assert "does not exist" in _error(tmp_path / "missing.yaml")
    other = tmp_path / "run.toml"
    other.write_text("seed = 1\n")
    assert "suffix '.toml'" in _error(other)


def test_omegaconf_object_and_model():
    node = OmegaConf.create(MINESTUDIO_EXAMPLE)
    expected = load_config(MINESTUDIO_EXAMPLE).config
    assert load_config(node).config == expected
    assert load_config(expected).config == expected
    assert load_config(expected, ["seed=9"]).config.seed == 9
    broken = OmegaConf.create({"seed": "${nowhere}"})
    assert "cannot be resolved" in _error(broken)


def test_round_trip_dict_model_yaml_model(tmp_path):
    cfg = load_config(GATE_KL_EXAMPLE, ["env_config={name: crafter, size: 64}"]).config
    text = cfg.to_yaml()
    again = validate_online_config(yaml.safe_load(text))
    assert again == cfg and again.to_dict() == cfg.to_dict()
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(path).config == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # shipped to Ray actors as is


def test_paths_resolve_under_the_run_dir(tmp_path):
    cfg = validate_online_config({"output_dir": str(tmp_path), "run_name": "exp1"})
    assert cfg.run_dir() == tmp_path / "exp1"
    assert cfg.resolve_path(cfg.train_config.save_path) == tmp_path / "exp1" / "checkpoints"
    assert cfg.resolve_path("/abs/dir").as_posix() == "/abs/dir"
    relative = validate_online_config({"output_dir": "runs"})
    assert relative.run_dir().is_absolute()
    assert re.fullmatch(r"run-\d{8}-\d{6}", relative.run_name)
    named = validate_online_config({"logger_config": {"name": "bow cow/v2"}})
    assert named.run_name == "bow-cow-v2"
    assert "plain directory name" in _error({"run_name": "../elsewhere"})


def test_public_lazy_exports():
    assert mineonline_core.load_config is load_config
    assert mineonline_core.OnlineConfig is OnlineConfig
