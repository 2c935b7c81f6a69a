"""Non-finite values in training: an optimiser step with a NaN loss or gradient is skipped and counted,
K skips in a row stop the run naming what went non-finite, and NaN weights are never broadcast or saved."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.errors import RunFailedError
from mineonline_core.services.finite import env_answer_problem, nonfinite_leaves
from mineonline_core.testing.kit import cartpole, chunks_of, local_loop, rollout_fragments
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages


def make_trainer(tmp_path, **train) -> PPOTrainer:
    train = {
        "num_iterations": 5,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 1,
        "context_length": 8,
        "learning_rate": 1e-2,
        "max_skipped_updates": 3,
        **train,
    }
    config = OnlineConfig(train_config=train, rollout_config={"fragment_length": 8})
    trainer = local_loop(PPOTrainer, config, run_dir=str(tmp_path))
    return trainer


def make_batch(trainer: PPOTrainer, *, nan_reward: bool) -> dict:
    streams = rollout_fragments(
        trainer.policy, lambda i: cartpole(12), num_envs=2, fragment_length=8, fragments_per_env=2
    )
    chunks = chunks_of(streams, 1)
    if nan_reward:
        chunks[1][0][F.REWARD][3] = np.nan  # one stored step of one chunk, as an env that returned NaN left it
    batch = assemble_chunks(chunks)
    return estimate_advantages(trainer.model, batch, version=0, context_length=8, discount=0.9, gae_lambda=0.95)


def params(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run_after_k(tmp_path, caplog) -> None:
    trainer = make_trainer(tmp_path)
    trainer.iteration = 1
    clean = trainer.train(make_batch(trainer, nan_reward=False))
    assert trainer.update_guard.skipped_total == 0 and math.isfinite(clean["trainer/policy_loss"])
    before = params(trainer)
    with caplog.at_level("WARNING", logger="mineonline_core.services.finite"):
        trainer.train(make_batch(trainer, nan_reward=True))  # two optimiser steps, both non-finite
    after = params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the weights"
    assert all(torch.isfinite(v).all() for v in after.values())
    assert trainer.update_guard.skipped_iteration == 2 and trainer.update_guard.consecutive == 2
    assert any("optimiser step skipped" in r.getMessage() and "loss terms" in r.getMessage() for r in caplog.records)
    trainer.train(make_batch(trainer, nan_reward=False))  # a finite step ends the row
    assert trainer.update_guard.consecutive == 0 and trainer.update_guard.skipped_total == 2
    with pytest.raises(RunFailedError) as failure:
        for _ in range(2):
            trainer.train(make_batch(trainer, nan_reward=True))
    message = str(failure.value)
    assert "3 optimiser steps in a row" in message and "max_skipped_updates=3" in message
    assert "policy_loss" in message or "value_loss" in message  # what went non-finite
    assert "gradients of 'actor." in message  # where


def test_nonfinite_weights_are_never_broadcast_or_checkpointed(tmp_path) -> None:
    trainer = make_trainer(tmp_path)
    trainer.iteration = 4
    with torch.no_grad():
        next(trainer.policy.parameters())[0, 0] = float("inf")
    with pytest.raises(RunFailedError, match="not checkpointed"):
        trainer.save_checkpoint()
    assert ckpt.list_checkpoints(trainer.save_dir) == []
    with pytest.raises(RunFailedError, match=r"not broadcast.*\(1 of"):
        trainer._publish_weights()


def test_env_answer_problems_name_the_key() -> None:
    assert env_answer_problem(1.0, {"obs": np.zeros(3, np.float32), "img": np.zeros(2, np.uint8)}, None) is None
    assert env_answer_problem(float("nan"), {"obs": np.zeros(3)}, None) == "reward is nan"
    obs = {"pov": np.zeros(4, np.uint8), "inventory": {"wood": np.array([1.0, np.inf])}}
    assert "observation key 'inventory.wood' (1 of 2 values)" in env_answer_problem(0.0, obs, None)
    assert "final observation" in env_answer_problem(0.0, {"a": np.ones(1)}, [np.array([np.nan])])
    assert nonfinite_leaves([torch.tensor([1.0, float("nan")]), None, 3]) == [("[0]", 1, 2)]


def test_half_precision_weights_of_large_finite_sums_are_finite() -> None:
    """100k fp16 ones sum to inf in fp16: the quick check must not call such weights "maybe not finite"."""
    from mineonline_core.services.finite import surely_finite

    assert surely_finite([torch.ones(100_000, dtype=torch.float16), torch.ones(100_000, dtype=torch.bfloat16)])
    assert not surely_finite([torch.tensor([1.0, float("nan")], dtype=torch.float16)])
