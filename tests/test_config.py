"""Config models, loaders, error messages and cross-field checks (fast, no Ray)."""

from __future__ import annotations

import copy
import math
import pickle
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import cloudpickle
import pytest
import yaml
from omegaconf import OmegaConf

import mineonline_core
from mineonline_core.config import (
    LoadedConfig,
    OnlineConfig,
    check_consistency,
    check_resources,
    config_docs,
    config_template,
    load_config,
    validate_online_config,
)
from mineonline_core.errors import ConfigError, MineOnlineError

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


def _with(path: str, value) -> dict:
    data: dict = {}
    node = data
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return data


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


# --- error messages -------------------------------------------------------------------------


def _trainer_error(data: dict, overrides=()) -> str:
    """The error ``resolve()`` raises for the selected trainer's own train_config keys (its first check)."""
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    with pytest.raises(ConfigError) as info:
        resolve(load_config(data, overrides), get_plugin_manager(), probe=False)
    return str(info.value)


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


def test_template_loads_back_to_defaults(tmp_path):
    text = config_template()
    assert "# Initial learning rate" in text and "learning_rate: 2.0e-05" in text
    path = tmp_path / "template.yaml"
    path.write_text(text)
    loaded = load_config(path).config
    # The default trainer's own keys are in train_config too, each at its default.
    from mineonline_ppo import PPOConfig

    assert loaded.train_config.model_extra == PPOConfig().model_dump()
    expected = OnlineConfig(train_config=PPOConfig().model_dump()).model_dump(exclude={"run_name"})
    assert loaded.model_dump(exclude={"run_name"}) == expected


def test_docs_list_every_key_with_type_default_and_range():
    docs = config_docs()
    for path, _ in _leaves(MINESTUDIO_EXAMPLE):
        if path[-1] != "episode_statistics_config":
            assert f"`{'.'.join(path)}`" in docs, path
    assert "| `train_config.gae_lambda` | float | `0.95` | 0 <= x <= 1 |" in docs
    assert "| `train_config.resume` | str \\| None | `null` |" in docs
    assert "## `train_config` keys of the trainer `PPOTrainer` (mineonline-ppo)" in docs
    assert "| `train_config.coef_rho_decay` | float | `0.9995` | 0 < x <= 1 |" in docs
    assert "## Overrides on the command line" in docs


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


def test_committed_reference_is_current():
    committed = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert committed.read_text(encoding="utf-8") == config_docs(), (
        "docs/configuration.md is stale: run `mineonline config docs --output docs/configuration.md`."
    )
