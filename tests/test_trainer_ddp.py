"""DDP: 2 CPU ranks (Ray Train, gloo, fractional CPUs) make the same update as 1 rank on the same
global batch, with global advantage normalisation and the value normaliser fed from every rank.
One optimiser step per epoch: minibatches are reshuffled every epoch, and a step over all of them
does not depend on how they were cut."""

from __future__ import annotations

import pytest
import ray
import torch

from mineonline_core.testing.kit import cartpole, chunks_of, ddp_fit, ddp_train_step, mlp_policy, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, address="local", include_dashboard=False)
    yield
    ray.shutdown()


def test_two_ranks_equal_one_rank(tmp_path, ray_local):
    torch.manual_seed(0)
    policy = mlp_policy()
    streams = rollout_fragments(policy, lambda i: cartpole(12), num_envs=4, fragment_length=8, fragments_per_env=2)
    batch = estimate_advantages(policy, assemble_chunks(chunks_of(streams, 1)), version=0, context_length=8,
                                discount=0.9, gae_lambda=0.95)  # fmt: skip
    assert batch["reward"].shape == (8, 8)
    batch_path = tmp_path / "batch.pt"
    torch.save(batch, batch_path)
    common = {"learning_rate": 1e-2, "adam_eps": 1.0, "max_grad_norm": 0.5, "batches_per_iteration": 2,
              "gradient_accumulation": 2, "context_length": 4, "epochs_per_iteration": 2, "entropy_bonus_coef": 0.01}  # fmt: skip
    # The single-rank reference runs the same code in-process (no DDP wrapper, no process group).
    ddp_train_step({"trainer_cls": "mineonline_ppo:PPOTrainer", "online": {"train_config": {**common, "batch_size_per_gpu": 4}},
                    "batch_path": str(batch_path), "out_path": str(tmp_path / "one.pt"), "run_dir": str(tmp_path), "local": True})
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two, _ = ddp_fit(trainer_cls="mineonline_ppo:PPOTrainer", online={"train_config": {**common, "batch_size_per_gpu": 2}},
                     batch_path=str(batch_path), run_dir=str(tmp_path), tag="two")  # fmt: skip
    initial = mlp_policy().state_dict()
    assert not torch.equal(one["actor.0.weight"], initial["actor.0.weight"])  # it did train
    assert not torch.equal(one["value_head.normalizer.running_mean"], initial["value_head.normalizer.running_mean"])
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6), (name, (one[name] - two[name]).abs().max())
