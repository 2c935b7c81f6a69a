"""The per-iteration ``estimate`` hook and the helper an off-policy estimate builds on."""

from __future__ import annotations

import torch

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.testing.kit import TinyImageEnv, chunks_of, cnn_policy, rollout_fragments
from mineonline_core.trainer import BaseTrainer
from mineonline_core.trainer.batch import assemble_chunks, current_policy_outputs


class LossOnly(BaseTrainer):
    name = "LossOnly"

    def compute_loss(self, *, batch, outputs):
        return (outputs["vpred"] - batch[F.VALUE_TARGET]).pow(2).mean(), {}


def test_current_policy_outputs_reproduce_the_rollout_and_feed_the_default_estimate(tmp_path):
    """A recurrent policy over chunks of two fragments, windows shorter than a fragment: what the
    helper recomputes from the stored states is what the behaviour policy recorded step by step."""
    config = OnlineConfig(train_config={"context_length": 3})
    trainer = LossOnly(
        rollout_manager=None, policy_generator=cnn_policy, env_generator=None, config=config, run_dir=str(tmp_path)
    )
    trainer.setup_rank(local=True)
    streams = rollout_fragments(
        trainer.policy, lambda i: TinyImageEnv(seed=i), num_envs=2, fragment_length=4, fragments_per_env=2
    )
    batch = assemble_chunks(chunks_of(streams, 2))
    assert batch[F.FIRST][:, 1:].any()  # episodes restart inside the chunks
    current = trainer.current_policy_outputs(batch=batch)
    assert current["logprob"].shape == current["value"].shape == batch[F.REWARD].shape
    assert current["next_value"].shape == (batch[F.REWARD].shape[0],)
    torch.testing.assert_close(current["logprob"], batch[F.LOGPROB], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(current["value"], batch[F.VPRED], atol=1e-5, rtol=1e-5)
    estimated = trainer.algorithm.estimate(batch=dict(batch))
    torch.testing.assert_close(estimated[F.VALUE], current["value"])
    assert estimated[F.ADVANTAGE].shape == batch[F.REWARD].shape


def test_an_estimate_override_feeds_the_loss(tmp_path):
    """What ``estimate`` returns is what ``compute_loss`` sees (sliced to its window)."""
    seen = []

    class Constant(LossOnly):
        name = "Constant"

        def estimate(self, *, batch):
            batch[F.VALUE] = torch.zeros_like(batch[F.REWARD])
            batch[F.RETURN] = torch.full_like(batch[F.REWARD], 7.0)
            batch[F.ADVANTAGE] = torch.ones_like(batch[F.REWARD])
            return batch

        def compute_loss(self, *, batch, outputs):
            seen.append(batch[F.ADVANTAGE])
            return super().compute_loss(batch=batch, outputs=outputs)

    config = OnlineConfig(
        train_config={
            "context_length": 3,
            "use_normalized_vf": False,
            "batch_size_per_gpu": 2,
            "batches_per_iteration": 1,
            "gradient_accumulation": 1,
        }
    )
    trainer = Constant(
        rollout_manager=None, policy_generator=cnn_policy, env_generator=None, config=config, run_dir=str(tmp_path)
    )
    trainer.setup_rank(local=True)
    trainer.iteration = 1
    streams = rollout_fragments(
        trainer.policy, lambda i: TinyImageEnv(seed=i), num_envs=2, fragment_length=4, fragments_per_env=2
    )
    batch = trainer.algorithm.estimate(batch=assemble_chunks(chunks_of(streams, 2)))
    metrics = trainer.train(batch)
    assert len(seen) == 3 and all(bool((a == 1).all()) for a in seen)  # windows of 3, 3 and 2 steps
    assert [a.shape[1] for a in seen] == [3, 3, 2]
    assert metrics["trainer/grad_norm"] > 0


def test_the_estimate_pass_runs_micro_batches_and_equals_the_whole_batch_pass(tmp_path):
    """Issue 24: memory bounded by the micro-batch. The trainer's estimate forwards at most
    ``batch_size_per_gpu`` chunks at once (the update's shapes) and gives what one forward over
    every chunk gives."""
    config = OnlineConfig(train_config={"context_length": 3, "batch_size_per_gpu": 2})
    trainer = LossOnly(
        rollout_manager=None, policy_generator=cnn_policy, env_generator=None, config=config, run_dir=str(tmp_path)
    )
    trainer.setup_rank(local=True)
    streams = rollout_fragments(
        trainer.policy, lambda i: TinyImageEnv(seed=i), num_envs=5, fragment_length=4, fragments_per_env=2
    )
    batch = assemble_chunks(chunks_of(streams, 2))
    whole = current_policy_outputs(trainer.policy, batch, context_length=3)  # every chunk in one forward
    sizes: list[int] = []
    hook = trainer.policy.register_forward_hook(
        lambda m, args, kwargs, out: sizes.append(kwargs["input"]["image"].shape[0]), with_kwargs=True
    )
    try:
        estimated = trainer.algorithm.estimate(batch=dict(batch))
    finally:
        hook.remove()
    # 5 chunks of 8 steps: slices of 2, 2 and 1 chunks, each in 3 windows and one next_obs step.
    assert sizes == [2] * 4 + [2] * 4 + [1] * 4
    for key, column in (("logprob", F.LOGPROB_PROX), ("vpred", F.OLD_VPRED), ("value", F.VALUE)):
        torch.testing.assert_close(estimated[column], whole[key], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        trainer.current_policy_outputs(batch=batch)["next_value"], whole["next_value"], atol=1e-6, rtol=0
    )
