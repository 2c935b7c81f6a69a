"""Switching the algorithm by name (issue 26): a config written for PPO runs with another installed
trainer selected on the command line; PPO's keys are set aside with one warning naming them, and a key
that no installed trainer owns is still an error. Uses the real PPO plugin and the REINFORCE example."""

from __future__ import annotations

import logging

import pytest

from mineonline_core.config import load_config
from mineonline_core.errors import ConfigError
from mineonline_core.registry import Origin, get_plugin_manager
from mineonline_core.driver.resolve import resolve_trainer
from tests.test_trainer_custom import _load_example

CARTPOLE = "examples/cartpole.yaml"
PPO_KEYS = ["clip_vloss", "entropy_bonus_coef", "kl_divergence_coef_rho", "ppo_clip", "ppo_vf_coef", "zero_initial_vf"]


@pytest.fixture()
def pm():
    module, pm = _load_example(), get_plugin_manager()
    pm.add_plugin(module, Origin("reinforce", "mineonline-reinforce-example", "0.1.0"))
    yield pm
    pm.remove_plugin(module)


def test_other_trainers_keys_are_set_aside_with_one_warning(pm, caplog):
    loaded = load_config(CARTPOLE, ["trainer_name=ReinforceTrainer", "train_config.vf_coef=0.25"])
    with caplog.at_level(logging.WARNING, logger="mineonline_core.driver.resolve"):
        cls, options = resolve_trainer(loaded, pm)
    assert cls.name == "ReinforceTrainer" and options.vf_coef == 0.25
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    named = [key for key in PPO_KEYS if key in warnings[0]]
    assert named == [key for key in PPO_KEYS if key in (load_config(CARTPOLE).config.train_config.model_extra or {})]
    assert "PPOTrainer" in warnings[0] and "ReinforceTrainer" in warnings[0]
    # Gone from the resolved config: the run's saved config.yaml holds only what it used.
    assert not set(PPO_KEYS) & set(loaded.config.train_config.model_extra or {})


def test_key_no_installed_trainer_owns_is_still_an_error(pm):
    loaded = load_config(CARTPOLE, ["trainer_name=ReinforceTrainer", "train_config.ppo_clipp=0.1"])
    with pytest.raises(ConfigError, match=r"train_config\.ppo_clipp: unknown key for trainer 'ReinforceTrainer'"):
        resolve_trainer(loaded, pm)


def test_the_selected_trainers_own_keys_stay_with_it(pm):
    # PPO selected: its keys are its own, nothing is set aside, and REINFORCE's key is set aside instead.
    loaded = load_config(CARTPOLE, ["train_config.vf_coef=0.25"])
    cls, options = resolve_trainer(loaded, pm)
    assert cls.name == "PPOTrainer" and options.ppo_clip == 0.2
    assert "vf_coef" not in (loaded.config.train_config.model_extra or {})
