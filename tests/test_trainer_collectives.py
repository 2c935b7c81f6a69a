"""The update loop's decisions across ranks (``trainer/update.py``) on two real gloo ranks, each in its own process,
in a torch.distributed process group as Ray Train makes for CPU ranks:

* the advantages are normalised with the statistics of every rank's values together, not each rank's own;
* a step that one rank finds non-finite is skipped by every rank (the ranks' parameters stay equal).

The same decisions inside a whole PPO update on Ray Train ranks are ``tests/test_trainer_ddp.py``; these take
seconds, so the mutation check runs them first.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from mineonline_core.services.finite import UpdateGuard
from mineonline_core.trainer.update import UpdateLoop

# Each rank's advantages: different sizes and spreads, so that no rank's own statistics are the global ones.
VALUES = (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, -6.0, 0.5, 7.0, 2.0, -1.0]))
# Each rank's loss terms for one optimiser step: rank 1's went non-finite, rank 0's did not.
LOSS_TERMS = ({"policy_loss": 0.5, "value_loss": 0.25}, {"policy_loss": float("nan"), "value_loss": 0.25})


class _Rank(UpdateLoop):
    """The state of ``TrainLoop`` that the update loop's cross-rank methods read."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.device, self.iteration = rank, 2, torch.device("cpu"), 1
        self.model = torch.nn.Linear(2, 1)
        self.update_guard = UpdateGuard(max_consecutive=3)


def _run_rank(rank: int, rendezvous: str, out: str) -> None:
    timeout = datetime.timedelta(seconds=120)  # a rank that died fails the other, not after gloo's 30 minutes
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2, timeout=timeout)
    try:
        loop = _Rank(rank)
        mean, std = loop.global_mean_std(VALUES[rank])
        step = loop.update_is_finite(grad_norm=1.0, loss_terms=LOSS_TERMS[rank])
        torch.save({"mean": mean, "std": std, "step": step}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    # Forked: a spawned rank could not import this file (another distribution installs a package named ``tests``),
    # and a fork starts in milliseconds. A rank runs nothing of torch's thread pools, which a fork would not carry.
    torch.multiprocessing.start_processes(
        _run_rank, args=(str(out / "rendezvous"), str(out)), nprocs=2, join=True, start_method="fork"
    )
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_advantage_statistics_are_those_of_every_ranks_values(two_ranks) -> None:
    together = torch.cat(VALUES)
    for rank in two_ranks:
        assert torch.allclose(rank["mean"], together.mean()), (rank["mean"], together.mean())
        assert torch.allclose(rank["std"], together.std()), (rank["std"], together.std())


def test_a_step_one_rank_finds_non_finite_is_skipped_on_every_rank(two_ranks) -> None:
    assert [rank["step"] for rank in two_ranks] == [False, False]
