"""The weight broadcast off the trainer's critical path (``trainer/publish.py``): each version reaches
the rollout side in order with the weights it had when it was published (a snapshot the next
optimiser step cannot change), and a failure on the broadcast thread surfaces on the trainer."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from mineonline_core.config import OnlineConfig
from mineonline_core.errors import RunFailedError
from mineonline_core.testing.kit import mlp_policy
from mineonline_ppo import PPOTrainer


def make_trainer(tmp_path, manager=None, cls=PPOTrainer) -> PPOTrainer:
    config = OnlineConfig(
        train_config={"context_length": 8, "batches_per_iteration": 2, "gradient_accumulation": 1},
        rollout_config={"fragment_length": 8},
    )
    trainer = cls(
        rollout_manager=manager, policy_generator=mlp_policy, env_generator=None, config=config, run_dir=str(tmp_path)
    )
    trainer.setup_rank(local=True)
    return trainer


def fill(trainer: PPOTrainer, value: float) -> None:
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.fill_(value)


def test_versions_arrive_in_order_with_the_weights_they_were_published_with(local_ray, tmp_path) -> None:
    ray = local_ray

    @ray.remote(num_cpus=0)
    class Receiver:
        """Takes ``update_weights`` as a rollout worker and the manager do, and records what arrived."""

        def __init__(self) -> None:
            self.got: list[tuple[int, float]] = []

        def update_weights(self, weights: list, version: int, forward: bool = True) -> None:
            state = ray.get(weights[0])
            self.got.append((version, float(np.mean([v.mean() for v in state.values()]))))

        def received(self) -> list[tuple[int, float]]:
            return self.got

    worker, manager = Receiver.remote(), Receiver.remote()
    trainer = make_trainer(tmp_path, manager)
    trainer._workers = [worker]
    trainer._publish_weights()  # creates the broadcast thread
    trainer.flush_broadcast()
    # Hold the broadcast thread so that version 1 is still unsent when the "optimiser step" changes
    # the weights: what it sends must be the snapshot, not the live parameters.
    gate = threading.Event()
    trainer._broadcaster.submit(gate.wait)
    for version in (1, 2, 3):
        fill(trainer, float(version))
        trainer.version = version
        if version == 1:
            trainer._publish_weights()
            fill(trainer, 99.0)  # an optimiser step while version 1 waits for the thread
            gate.set()
        else:
            trainer._publish_weights()
    trainer.flush_broadcast()
    for receiver in (worker, manager):
        got = ray.get(receiver.received.remote())
        assert [v for v, _ in got] == [0, 1, 2, 3]
        assert [m for _, m in got[1:]] == pytest.approx([1.0, 2.0, 3.0])
    assert trainer.perf["perf/broadcast_send_ms"] >= 0


def test_nonfinite_weights_are_refused_before_the_broadcast_thread(tmp_path) -> None:
    trainer = make_trainer(tmp_path)
    with torch.no_grad():
        next(trainer.policy.parameters())[0, 0] = float("nan")
    with pytest.raises(RunFailedError, match=r"not broadcast to the rollout workers: '.*' \(1 of"):
        trainer._publish_weights()
    assert trainer._broadcast is None and trainer._broadcaster is None  # nothing was handed to the thread


class StoreFull(PPOTrainer):
    def _put_weights(self, weights):
        raise MemoryError("object store full")


def test_a_failed_broadcast_surfaces_on_the_next_iteration_with_its_cause(tmp_path, caplog) -> None:
    trainer = make_trainer(tmp_path, cls=StoreFull)
    trainer.version = 4
    with caplog.at_level(logging.ERROR, logger="mineonline_core.trainer.publish"):
        trainer._publish_weights()  # returns: the failure happens on the broadcast thread
        trainer._broadcast[1].exception()  # wait for it to fail
    assert any("model version 4" in r.getMessage() and r.exc_info for r in caplog.records)  # logged where it failed
    with pytest.raises(
        RunFailedError, match=r"Broadcasting model version 4 .* failed: MemoryError: object store full"
    ) as info:
        trainer.run_iteration(5)  # before it fetches anything
    assert isinstance(info.value.__cause__, MemoryError)
    assert trainer._broadcast is None  # raised once, not again at the next broadcast
