"""Trainers are selected by name: PPOTrainer from its installed plugin, and a third-party trainer
(the REINFORCE example) registered in a fresh plugin manager, which then trains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mineonline_core.config import OnlineConfig
from mineonline_core.errors import UnknownComponentError
from mineonline_core.registry import Origin, get_plugin_manager
from mineonline_core.testing.kit import cartpole, chunks_of, local_loop, rollout_fragments
from mineonline_core.testing.trainer_conformance import TrainerConformance
from mineonline_core.trainer import Algorithm
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_trainer" / "mineonline_reinforce.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("mineonline_reinforce", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestReinforceConformance(TrainerConformance):
    trainer_cls = _load_example().ReinforceTrainer
    trainer_options = {"entropy_coef": 0.01}


def test_ppo_trainer_is_registered_by_its_plugin():
    pm = get_plugin_manager()
    cls = pm.lookup("trainer", "PPOTrainer")
    assert issubclass(cls, Algorithm) and cls.name == "PPOTrainer"
    assert pm.registries["trainer"].origin("PPOTrainer").distribution == "mineonline-ppo"


def test_custom_trainer_selected_by_name_and_trains(tmp_path):
    module = _load_example()
    pm = get_plugin_manager(load_entry_points=False)
    with pytest.raises(UnknownComponentError, match="ReinforceTrainer"):
        pm.lookup("trainer", "ReinforceTrainer")
    origin = Origin("reinforce", "mineonline-reinforce-example", "0.1.0")
    pm.add_plugin(module, origin)
    try:
        cls = pm.lookup("trainer", OnlineConfig(trainer_name="ReinforceTrainer").trainer_name)
        assert cls is module.ReinforceTrainer
        config = OnlineConfig(
            trainer_name="ReinforceTrainer", train_config={"learning_rate": 1e-2, "context_length": 8, "vf_coef": 0.25}
        )
        trainer = local_loop(cls, config, run_dir=str(tmp_path))
        streams = rollout_fragments(
            trainer.policy, lambda i: cartpole(12), num_envs=2, fragment_length=8, fragments_per_env=2
        )
        batch = estimate_advantages(
            trainer.model,
            assemble_chunks(chunks_of(streams, 2)),
            version=0,
            context_length=8,
            discount=0.9,
            gae_lambda=1.0,
        )
        assert trainer.options.vf_coef == 0.25
        before = trainer.policy.actor[0].weight.detach().clone()
        metrics = trainer.train(batch)
        assert metrics["trainer/grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["trainer/policy_loss"]))
        assert not torch.equal(before, trainer.policy.actor[0].weight)
    finally:
        pm.remove_plugin(module)
    assert "ReinforceTrainer" not in pm.registries["trainer"]
