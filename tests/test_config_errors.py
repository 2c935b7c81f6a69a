"""Config error messages (the key, the value and the fix) and the cross-field checks (fast, no Ray)."""

from __future__ import annotations

import math

import pytest

from mineonline_core.config import OnlineConfig, check_consistency, check_resources, load_config, validate_online_config
from mineonline_core.errors import ConfigError, MineOnlineError
from tests.test_config_loading import GATE_KL_EXAMPLE, MINESTUDIO_EXAMPLE, _error, _trainer_error


def _with(path: str, value) -> dict:
    data: dict = {}
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


# --- error messages -------------------------------------------------------------------------


def test_typo_names_the_intended_key():
    message = _error({"rollout_config": {"fragment_lenght": 1}})
    assert "rollout_config.fragment_lenght: unknown key (value 1)" in message
    assert "Did you mean 'fragment_length'?" in message
    # train_config's other keys belong to the selected trainer: resolve() names the trainer too.
    message = _trainer_error({"train_config": {"learning_rat": 1}})
    assert "train_config.learning_rat: unknown key for trainer 'PPOTrainer' (value 1)" in message
    assert "Did you mean 'learning_rate'?" in message
    assert "Did you mean 'ppo_vf_coef'" in _trainer_error({"train_config": {"ppo_vf_coeff": 0.5}})


def test_unknown_nested_section_key_and_key_without_close_match():
    message = _error(_with("rollout_config.replay_buffer_config.max_chunk", 10))
    assert "rollout_config.replay_buffer_config.max_chunk: unknown key" in message
    assert "'max_chunks'" in message
    message = _error({"rollout_config": {"zzzz": 1}})
    assert "rollout_config.zzzz: unknown key" in message and "fragment_length" in message
    assert "Did you mean" not in message
    message = _trainer_error({"train_config": {"zzzz": 1}})
    assert "train_config.zzzz: unknown key for trainer 'PPOTrainer'" in message and "ppo_clip" in message
    assert "Did you mean" not in message
    assert "Did you mean 'trainer_name'" in _error({"trainer_nme": "PPOTrainer"})


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("train_config.learning_rate", -1e-4, "must be > 0"),
        ("train_config.gae_lambda", 1.5, "0 <= x <= 1"),
        ("train_config.discount", 0.0, "0 < x <= 1"),
        ("rollout_config.fragment_length", 0, "must be >= 1"),
        ("rollout_config.replay_buffer_config.max_reuse", 0, "must be >= 1"),
        ("rollout_config.replay_buffer_config.max_staleness", -1, "must be >= 0"),
        ("rollout_config.num_gpus_per_worker", -0.5, "must be >= 0"),
        ("train_config.num_cpus_per_worker", 0, "must be > 0"),
        ("train_config.record_video_interval", -1, "must be >= 0"),
        ("train_config.save_interval", 0, "must be >= 1"),
        ("train_config.learning_rate", math.inf, "finite number"),
        ("train_config.learning_rate", math.nan, "finite number"),
    ],
)
def test_out_of_range_value_names_key_value_and_fix(path, value, expect):
    message = _error(_with(path, value))
    assert f"{path}: " in message and repr(value) in message
    assert expect in message and "Fix:" in message
    assert len([line for line in message.splitlines() if line.startswith("  - ")]) == 1


@pytest.mark.parametrize(
    ("path", "value", "noun"),
    [
        ("train_config.learning_rate", "fast", "a number"),
        ("rollout_config.worker_config.num_envs", 2.5, "a whole number"),
        ("train_config.use_amp", "maybe", "true or false"),
        ("trainer_name", 5, "a string"),
        ("rollout_config", 7, "a mapping"),
        ("logger_config.loggers", "wandb", "a list"),
        ("train_config.learning_rate", True, "a number"),
        ("seed", False, "an integer"),
    ],
)
def test_wrong_type_names_key_value_and_fix(path, value, noun):
    message = _error(_with(path, value))
    assert f"{path}: must be {noun}" in message and repr(value) in message and "Fix:" in message


@pytest.mark.parametrize(
    ("path", "value", "expect"),
    [
        ("train_config.ppo_clip", 0, "must be > 0"),
        ("train_config.ppo_clip", -0.1, "must be > 0"),
        ("train_config.coef_rho_decay", 1.5, "0 < x <= 1"),
        ("train_config.clip_vloss", "maybe", "must be true or false"),
        ("train_config.ppo_vf_coef", math.nan, "finite number"),
        ("train_config.vf_warmup", True, "must be an integer"),
    ],
)
def test_a_bad_trainer_value_names_key_value_trainer_and_fix(path, value, expect):
    message = _trainer_error(_with(path, value))
    assert message.startswith("Invalid train_config for trainer 'PPOTrainer' (1 problem)")
    assert f"{path}: " in message and repr(value) in message and expect in message and "Fix:" in message


def test_all_problems_reported_in_one_error():
    data = {"train_config": {"learning_rate": -1, "ppo_clip": -1}, "seed": -1, "bogus": {}}
    message = _error(data)
    assert message.startswith("Invalid config (3 problems")
    assert "train_config.learning_rate: must be > 0" in message
    assert "seed: must be >= 0" in message and "bogus: unknown key" in message
    message = _trainer_error({"train_config": {"learning_rat": 1, "ppo_clip": -1}})
    assert message.startswith("Invalid train_config for trainer 'PPOTrainer' (2 problems")
    assert "'learning_rate'" in message and "train_config.ppo_clip: must be > 0" in message


def test_error_types_are_mineonline_errors():
    with pytest.raises(MineOnlineError):
        validate_online_config(["not", "a", "mapping"])
    with pytest.raises(ConfigError, match="Cannot read a config from 42"):
        load_config(42)


def test_minestudio_conventions_for_resume_and_save_path():
    cfg = validate_online_config({"train_config": {"resume": "", "save_path": None}})
    assert cfg.train_config.resume is None and cfg.train_config.save_path == "checkpoints"


def test_component_configs_and_logger_extras():
    cfg = validate_online_config(
        {
            "env_config": {"name": "crafter", "size": 64},
            "logger_config": {"loggers": [], "entity": "me"},
            "rollout_config": {"replay_buffer_config": {"database_config": {"map_size": 1}}},
        }
    )
    assert cfg.env_config.name == "crafter" and cfg.env_config.model_extra == {"size": 64}
    assert cfg.logger_config.model_extra == {"entity": "me"}
    database = cfg.rollout_config.replay_buffer_config.database_config
    assert database.model_extra == {"map_size": 1}
    assert "env_config.name: required key is missing" in _error({"env_config": {"size": 1}})
    assert "more than once" in _error({"logger_config": {"loggers": ["wandb", "wandb"]}})


# --- cross-field checks ---------------------------------------------------------------------


def test_consistency_accepts_defaults_and_examples():
    check_consistency(OnlineConfig())
    check_consistency(validate_online_config(GATE_KL_EXAMPLE))


@pytest.mark.parametrize(
    ("data", "expect"),
    [
        (
            {"train_config": {"batches_per_iteration": 15, "gradient_accumulation": 10}},
            ["batches_per_iteration (15)", "gradient_accumulation (10)", "e.g. 20"],
        ),
        (
            {"rollout_config": {"worker_config": {"num_envs": 4, "batch_size": 6}}},
            ["batch_size (6)", "num_envs (4)", "at most 4"],
        ),
        (
            {
                "train_config": {
                    "num_workers": 4,
                    "batches_per_iteration": 50,
                    "gradient_accumulation": 1,
                    "batch_size_per_gpu": 2,
                },
                "rollout_config": {"replay_buffer_config": {"max_chunks": 100}},
            },
            ["needs 400 chunks", "max_chunks is 100", "at least 400"],
        ),
        (
            {"train_config": {"context_length": 300}, "rollout_config": {"fragment_length": 128}},
            ["context_length (300)", "128 steps", "at most 128"],
        ),
        (
            {"train_config": {"use_ray_train": False, "num_workers": 2}},
            ["use_ray_train is false", "num_workers is 2", "set use_ray_train to null"],
        ),
        ({"hang_timeout": 2}, ["hang_timeout is 2s", "at least 5", "or 0 to disable"]),
        (
            {"hang_timeout": 120, "progress_timeout": 100},
            ["hang_timeout (120s)", "progress_timeout (100s)", "lower hang_timeout below 100"],
        ),
    ],
)
def test_each_consistency_check(data, expect):
    cfg = validate_online_config(data)
    with pytest.raises(ConfigError) as info:
        check_consistency(cfg)
    for fragment in expect:
        assert fragment in str(info.value)
    assert "Fix:" in str(info.value)
    assert any(fragment in _error(data) for fragment in expect)  # load_config runs the checks


def test_resources_enough_and_short():
    check_resources(OnlineConfig(), {"CPU": 2.0, "GPU": 0.0})
    cfg = validate_online_config(MINESTUDIO_EXAMPLE)
    check_resources(cfg, {"CPU": 8.0, "GPU": 4.0})
    with pytest.raises(ConfigError) as info:
        check_resources(cfg, {"CPU": 2.0, "GPU": 0.0})
    message = str(info.value)
    assert "asks for 4 CPUs" in message and "has 2" in message
    assert "asks for 4 GPUs" in message and "has 0" in message
    assert "rollout_config.num_rollout_workers 2" in message and "add nodes" in message
    fractional = validate_online_config(
        {
            "rollout_config": {"num_cpus_per_worker": 0.5},
            "train_config": {"num_cpus_per_worker": 0.5},
        }
    )
    check_resources(fractional, {"CPU": 1.0})
    with pytest.raises(ConfigError, match="asks for 1 CPUs"):
        check_resources(fractional, {"CPU": 0.5})
