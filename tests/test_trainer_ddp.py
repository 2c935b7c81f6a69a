"""DDP: 2 CPU ranks (Ray Train, gloo, fractional CPUs) make the same update as 1 rank on the same
global batch, with global advantage normalisation and the value normaliser fed from every rank.
One optimiser step per epoch: minibatches are reshuffled every epoch, and a step over all of them
does not depend on how they were cut. Through the trainer's own iteration (fetch -> estimate ->
train) from a real ReplayBuffer, the ranks of one iteration train on disjoint chunks, and a
non-finite loss on one rank skips that optimiser step on every rank."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import ray.cloudpickle
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.rollout.buffer import ReplayBuffer
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.services.storehost import StoreClient, start_store_host
from mineonline_core.testing.kit import (
    cartpole,
    chunks_of,
    ddp_fit,
    ddp_run,
    ddp_train_step,
    mlp_policy,
    rollout_fragments,
)
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages
from mineonline_core.trainer.loop import TrainLoop

# The loop and the trainer below travel to the ranks, which cannot import this file.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_two_ranks_equal_one_rank(tmp_path, local_ray):
    torch.manual_seed(0)
    policy = mlp_policy()
    streams = rollout_fragments(policy, lambda i: cartpole(12), num_envs=4, fragment_length=8, fragments_per_env=2)
    batch = estimate_advantages(
        policy, assemble_chunks(chunks_of(streams, 1)), version=0, context_length=8, discount=0.9, gae_lambda=0.95
    )
    assert batch["reward"].shape == (8, 8)
    batch_path = tmp_path / "batch.pt"
    torch.save(batch, batch_path)
    common = {
        "learning_rate": 1e-2,
        "adam_eps": 1.0,
        "max_grad_norm": 0.5,
        "batches_per_iteration": 2,
        "gradient_accumulation": 2,
        "context_length": 4,
        "epochs_per_iteration": 2,
        "entropy_bonus_coef": 0.01,
    }
    # The single-rank reference runs the same code in-process (no DDP wrapper, no process group).
    ddp_train_step(
        {
            "trainer_cls": "mineonline_ppo:PPOTrainer",
            "online": {"train_config": {**common, "batch_size_per_gpu": 4}},
            "batch_path": str(batch_path),
            "out_path": str(tmp_path / "one.pt"),
            "run_dir": str(tmp_path),
            "local": True,
        }
    )
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two, _ = ddp_fit(
        trainer_cls="mineonline_ppo:PPOTrainer",
        online={"train_config": {**common, "batch_size_per_gpu": 2}},
        batch_path=str(batch_path),
        run_dir=str(tmp_path),
        tag="two",
    )
    initial = mlp_policy().state_dict()
    assert not torch.equal(one["actor.0.weight"], initial["actor.0.weight"])  # it did train
    assert not torch.equal(one["value_head.normalizer.running_mean"], initial["value_head.normalizer.running_mean"])
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6), (name, (one[name] - two[name]).abs().max())


class NaNOnRank1(PPOTrainer):
    """PPO that records the chunks each rank was served (their behaviour log-probs) and whose loss on
    rank 1 holds a NaN in the first window of iteration 1. The NaN is a constant, so the gradients
    (which DDP all-reduces, spreading any NaN to every rank) stay finite: only rank 1's loss terms
    show it, and only the ranks' agreement can make rank 0 skip that step too."""

    injected = False

    def estimate(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        self.served = batch[F.LOGPROB].clone()
        return super().estimate(batch=batch)

    def compute_loss(
        self, *, batch: dict[str, Any], outputs: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, stats = super().compute_loss(batch=batch, outputs=outputs)
        if self.ctx.rank == 1 and self.ctx.iteration == 1 and not self.injected:
            self.injected = True
            nan = torch.tensor(float("nan"))
            return loss + nan, {**stats, "injected": nan}
        return loss, stats

    def publishes_version(self, iteration: int) -> bool:
        return False  # no rollout side here to broadcast to


def _first_iteration(config: dict) -> None:
    """A Ray Train loop: iteration 1 on this rank at version 5; saves what the rank was served, its
    parameters before and after, and the iteration's metrics."""
    trainer = TrainLoop(
        algorithm=NaNOnRank1,
        rollout_manager=None,
        policy_generator=mlp_policy,
        env_generator=None,
        config=OnlineConfig(**config["online"]),
        run_dir=config["run_dir"],
    )
    trainer.setup_rank()
    trainer._buffer, trainer._store = config["buffer"], config["store"]
    trainer.version = 5
    initial = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    metrics = trainer.run_iteration(1)
    params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    torch.save(
        {"served": trainer.algorithm.served, "initial": initial, "params": params, "metrics": metrics},
        Path(config["run_dir"]) / f"rank{trainer.rank}.pt",
    )


@pytest.fixture(scope="module")
def first_iteration_on_two_ranks(local_ray, tmp_path_factory) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Iteration 1 of ``NaNOnRank1`` on 2 ranks, 4 chunks each (2 optimiser steps), from a real
    ReplayBuffer with max_reuse 2 holding issue 25's reproduction: 4 chunks of version 4 and 4 of
    version 5. Returns each rank's record and every chunk's behaviour log-probs by stream."""
    run_dir = tmp_path_factory.mktemp("iteration")
    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=16, max_reuse=2, max_staleness=1, version=5)
    )
    known = {}
    for version in (4, 5):
        streams = rollout_fragments(
            mlp_policy(),
            lambda i: cartpole(50),
            num_envs=4,
            fragment_length=8,
            fragments_per_env=1,
            version=version,
            seed=10 * version,
        )
        for i, (frag,) in enumerate(streams.values()):
            frag[F.STREAM] = f"v{version}.{i}"
            meta = fragment_meta(frag)
            store.put(meta["key"], frag)
            ray.get(buffer.add_fragment.remote(meta))
            known[frag[F.STREAM]] = frag[F.LOGPROB]
    train = {
        "num_iterations": 2,
        "prefetch_batches": 0,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 1,
        "context_length": 8,
        "learning_rate": 1e-2,
        "record_video_interval": 0,
    }
    config = {
        "online": {"rollout_config": {"fragment_length": 8}, "train_config": train},
        "run_dir": str(run_dir),
        "buffer": buffer,
        "store": store,
    }
    ddp_run(_first_iteration, config, run_dir=str(run_dir), tag="iteration")
    return [torch.load(run_dir / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)], known


def test_the_ranks_of_one_iteration_train_on_disjoint_chunks(first_iteration_on_two_ranks) -> None:
    ranks, known = first_iteration_on_two_ranks

    def streams(served: torch.Tensor) -> set[str]:
        return {name for row in served.numpy() for name, logprob in known.items() if np.array_equal(row, logprob)}

    rank0, rank1 = (streams(rank["served"]) for rank in ranks)
    assert len(rank0) == len(rank1) == 4
    # Freshest-first alone gives both ranks the 4 chunks of version 5 (max_reuse 2).
    assert rank0.isdisjoint(rank1), (rank0, rank1)
    assert rank0 | rank1 == set(known)


def test_a_non_finite_loss_on_one_rank_skips_that_step_on_every_rank(first_iteration_on_two_ranks) -> None:
    ranks, _ = first_iteration_on_two_ranks
    assert [rank["metrics"]["trainer/skipped_updates"] for rank in ranks] == [1.0, 1.0]
    params0, params1 = (rank["params"] for rank in ranks)
    for name in params0:
        assert torch.equal(params0[name], params1[name]), (name, (params0[name] - params1[name]).abs().max())
    assert not torch.equal(params0["actor.0.weight"], ranks[0]["initial"]["actor.0.weight"])  # the other step trained
