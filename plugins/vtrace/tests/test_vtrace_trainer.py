"""VTraceTrainer on real fragments from a step-by-step rollout: its importance weights come from the
stored behaviour log-probs, and an iteration moves the value towards the V-trace targets."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from mineonline_vtrace import RHO, VTraceTrainer, vtrace

from mineonline_core.config import OnlineConfig
from mineonline_core.config.messages import validate_trainer_options
from mineonline_core.contracts import fragment as F
from mineonline_core.errors import ConfigError
from mineonline_core.testing.kit import (
    TinyGRUPolicy,
    cartpole,
    chunks_of,
    local_loop,
    mlp_policy,
    rollout_fragments,
    time_limited_counting,
)
from mineonline_core.trainer.batch import assemble_chunks, denormalized_value
from mineonline_core.trainer.sequence import forward_sequence


def gru_policy() -> TinyGRUPolicy:
    torch.manual_seed(0)
    return TinyGRUPolicy()


def make_trainer(tmp_path, policy_fn=gru_policy, **train) -> VTraceTrainer:
    train = {
        "num_iterations": 5,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 1,
        "context_length": 5,
        "learning_rate": 1e-2,
        "discount": 0.9,
        **train,
    }
    config = OnlineConfig(train_config=train, rollout_config={"fragment_length": 8})
    trainer = local_loop(VTraceTrainer, config, run_dir=str(tmp_path), policy=policy_fn)
    trainer.iteration = 1
    return trainer


def chunks(behaviour: torch.nn.Module, env_fn=lambda i: time_limited_counting(i, limit=5)) -> dict:
    """Two streams of four 8-step fragments (episodes cut every 5 steps), as chunks of two fragments."""
    streams = rollout_fragments(behaviour, env_fn, num_envs=2, fragment_length=8, fragments_per_env=4)
    return assemble_chunks(chunks_of(streams, 2))


def test_on_policy_chunks_have_unit_importance_weights(tmp_path):
    """The trainer's forward over chunks (windows of 5, resets mid-chunk) reproduces the behaviour log-probs."""
    trainer = make_trainer(tmp_path)
    batch = trainer.algorithm.estimate(batch=chunks(trainer.policy))
    assert batch[F.TRUNCATED].any()
    assert (batch[RHO] - 1).abs().max().item() < 1e-5
    assert torch.allclose(batch[F.VALUE], batch[F.VPRED], atol=1e-5)


def test_stale_chunks_are_weighted_by_pi_over_mu(tmp_path):
    """Chunks from an older policy: rho = min(rho_bar, pi/mu) with mu the stored behaviour log-prob,
    and the targets differ from those that ignore the policy change."""
    trainer = make_trainer(tmp_path)
    behaviour = copy.deepcopy(trainer.policy)
    with torch.no_grad():
        trainer.policy.pi_head.linear.weight.add_(torch.randn_like(trainer.policy.pi_head.linear.weight))
    batch = trainer.algorithm.estimate(batch=chunks(behaviour))
    with torch.no_grad():
        latents, _ = forward_sequence(
            trainer.policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=16
        )
    pi = trainer.policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"])
    expected = (pi - batch[F.LOGPROB]).exp().clamp(max=1.0)
    assert (expected < 0.9).float().mean() > 0.1  # the policies differ enough for the check to bite
    assert torch.allclose(batch[RHO], expected, atol=1e-5)
    ignored = vtrace(
        behaviour_logprob=pi,
        target_logprob=pi,
        reward=batch[F.REWARD],
        value=batch[F.VALUE],
        next_value=torch.zeros(4),
        terminated=batch[F.TERMINATED],
        truncated=batch[F.TRUNCATED],
        bootstrap=batch[F.BOOTSTRAP],
        discount=0.9,
    )
    assert (batch[F.ADVANTAGE] - ignored.pg_advantage).abs().max() > 0.1


def test_an_iteration_moves_the_value_towards_the_vtrace_targets(tmp_path):
    trainer = make_trainer(
        tmp_path,
        policy_fn=lambda: mlp_policy(hidden=16),
        learning_rate=3e-3,
        epochs_per_iteration=4,
        batch_size_per_gpu=4,
        batches_per_iteration=1,
    )
    batch = chunks(trainer.policy, env_fn=lambda i: cartpole(12))
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    batch = trainer.algorithm.estimate(
        batch=batch
    )  # the iteration's targets (return = v_s) and values, before the update
    metrics = {**trainer.train(batch), **trainer.algorithm.iteration_metrics()}
    assert all(math.isfinite(v) for v in metrics.values())
    assert {"trainer/policy_loss", "trainer/value_loss", "trainer/entropy", "trainer/vtrace_rho_mean"} <= set(metrics)
    assert all(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())
    with torch.no_grad():
        latents, _ = forward_sequence(
            trainer.policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=16
        )
    value_after = denormalized_value(trainer.policy, latents["vpred"])
    error_before = (batch[F.VALUE] - batch[F.RETURN]).pow(2).mean()
    assert (value_after - batch[F.RETURN]).pow(2).mean() < 0.8 * error_before


@pytest.mark.parametrize("key,value", [("rho_bar", 0.0), ("c_bar", -1.0), ("ppo_clip", 0.2)])
def test_bad_options_name_the_key(key, value):
    """A non-positive truncation level, or a PPO-only key under trainer_name: VTraceTrainer, is refused."""
    train_config = OnlineConfig(trainer_name="VTraceTrainer", train_config={key: value}).train_config
    with pytest.raises(ConfigError, match=f"train_config.{key}"):
        validate_trainer_options(VTraceTrainer, train_config)
