"""The weight broadcast off the trainer's critical path (``trainer/publish.py``, ``trainer/snapshot.py``):
each version reaches the rollout side in order with the weights it had when it was published (a snapshot
the next optimiser step cannot change, in buffers the next version does not overwrite while ``ray.put``
reads them), bfloat16 and float16 parameters arrive bit-exactly, on CUDA the host copy runs on a side
stream into pinned buffers allocated once and only the broadcast thread waits for it, and a failure on
the broadcast thread surfaces on the trainer."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from mineonline_core.config import OnlineConfig
from mineonline_core.errors import RunFailedError
from mineonline_core.services import weights as W
from mineonline_core.services.weights import PackedWeights, WeightReceiver
from mineonline_core.testing.fakecuda import FakeCuda
from mineonline_core.testing.kit import mlp_policy
from mineonline_core.trainer import publish
from mineonline_core.trainer.snapshot import WeightSnapshot
from mineonline_core.trainer.loop import TrainLoop
from mineonline_ppo import PPOTrainer


def make_trainer(tmp_path, manager=None, cls=TrainLoop) -> TrainLoop:
    config = OnlineConfig(
        train_config={"context_length": 8, "batches_per_iteration": 2, "gradient_accumulation": 1},
        rollout_config={"fragment_length": 8},
    )
    trainer = cls(
        algorithm=PPOTrainer,
        rollout_manager=manager,
        policy_generator=mlp_policy,
        env_generator=None,
        config=config,
        run_dir=str(tmp_path),
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
            assert all(not a.flags.writeable for a in state.flats)  # views of the object store, not copies
            self.got.append((version, float(np.mean([float(v.float().mean()) for v in state.values()]))))

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


class StoreFull(TrainLoop):
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


class Recorder:
    """Stands in for the manager's handle: keeps a copy of every version's weights as it arrives."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.update_weights = self  # ``manager.update_weights.remote(...)``

    def remote(self, refs: list, version: int, forward: bool = True) -> None:
        self.sent.append((version, {k: v.clone() for k, v in refs[0].items()}))


class Unput(TrainLoop):
    """No Ray: the "ref" is the packed weights themselves."""

    def _put_weights(self, weights):
        return weights


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_parameters_are_broadcast_bit_exactly(tmp_path, dtype: torch.dtype) -> None:
    manager = Recorder()
    trainer = make_trainer(tmp_path, manager, cls=Unput)
    trainer.policy.to(dtype)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.normal_()
    trainer.version = 2
    trainer._publish_weights()
    trainer.flush_broadcast()
    ((version, state),) = manager.sent
    assert version == 2
    rollout = mlp_policy().to(dtype)
    WeightReceiver(device="cpu").load(rollout, state)
    for key, value in trainer.policy.state_dict().items():
        assert state[key].dtype == value.dtype and torch.equal(bits(state[key]), bits(value)), key
        assert torch.equal(bits(rollout.state_dict()[key]), bits(value)), key


class SignalOnWait(Future):
    """The broadcast in flight, seen by the trainer's thread: tells ``waiting`` when it is waited for."""

    def __init__(self, future: Future, waiting: threading.Event) -> None:
        super().__init__()
        self.future, self.waiting = future, waiting

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None):
        self.waiting.set()
        return self.future.result(timeout)


def test_the_next_version_does_not_overwrite_the_buffers_ray_put_is_reading(tmp_path) -> None:
    """Version 1's ``ray.put`` is still reading the snapshot's buffers when the trainer publishes version
    2: that publish must wait for the put, not copy version 2 into the same buffers under it."""
    next_version = threading.Event()  # the trainer waits for version 1, or has published version 2
    seen: list[float] = []

    class SlowPut(Unput):
        def _put_weights(self, weights: PackedWeights):
            if not seen:  # version 1: read the buffers only once version 2 had its chance to overwrite them
                next_version.wait()
            seen.append(float(torch.cat([v.float().flatten() for k, v in weights.items() if "norm" not in k]).max()))
            return weights

    trainer = make_trainer(tmp_path, Recorder(), cls=SlowPut)
    fill(trainer, 1.0)
    trainer.version = 1
    trainer._publish_weights()
    trainer._broadcast = (1, SignalOnWait(trainer._broadcast[1], next_version))

    def publish_version_2() -> None:
        fill(trainer, 2.0)
        trainer.version = 2
        trainer._publish_weights()
        next_version.set()

    second = threading.Thread(target=publish_version_2)
    second.start()
    second.join()
    trainer.flush_broadcast()
    assert seen == [1.0, 2.0]


def test_on_cuda_the_snapshot_reaches_pinned_buffers_on_a_side_stream_and_only_the_broadcast_thread_waits(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    fake = FakeCuda()
    fake.install(monkeypatch)
    # The CUDA path with the CPU's tensors: the fake stands in for the streams, events and pinning.
    monkeypatch.setattr(publish, "WeightSnapshot", lambda state: WeightSnapshot(state, staged=True))
    manager = Recorder()
    trainer = make_trainer(tmp_path, manager, cls=Unput)
    put = trainer._put_weights

    def logged_put(weights: PackedWeights) -> PackedWeights:
        fake.log.append(("put", threading.current_thread().name))
        return put(weights)

    trainer._put_weights = logged_put
    groups = W.layout(trainer.policy.state_dict())[0]
    fake.take()
    for version in (1, 2, 3):
        fill(trainer, float(version))
        trainer.version = version
        trainer._publish_weights()
        trainer.flush_broadcast()
        log = fake.take()
        written = next(i for i, e in enumerate(log) if e[0] == "record" and e[2] == "default")
        waits = log.index(("wait_event", "side0", log[written][1]))  # the side stream waits for the snapshot
        copies = [i for i, e in enumerate(log) if e[0] == "copy"]
        assert [log[i] for i in copies] == [("copy", True, "side0")] * len(groups)  # one per buffer, async
        copied = next(i for i, e in enumerate(log) if e[0] == "record" and e[2] == "side0")
        synced = log.index(("event_sync", log[copied][1], "mineonline-broadcast"))  # not the trainer's thread
        assert written < waits < copies[0] and copies[-1] < copied < synced < log.index(("put", "mineonline-broadcast"))
        if version > 1:  # the training stream overwrites the device buffers only after the last host copy
            assert log[0][:2] == ("wait_event", "default")
        assert ("device_sync",) not in log
        assert fake.async_unpinned == 0  # the host side of every asynchronous copy is a pinned buffer
        assert {e.id: e for e in fake.events}[log[synced][1]].blocking  # the broadcast thread sleeps, not spins
    assert fake.pinned == [(numel, dtype, True) for _, dtype, numel in groups]  # once, for three versions
    assert [v for v, _ in manager.sent] == [1, 2, 3]
    for version, state in manager.sent:
        assert all(bool((state[k] == version).all()) for k, _ in trainer.policy.named_parameters())

    trainer.policy.to(torch.bfloat16)  # another layout: new buffers, once
    trainer._publish_weights()
    trainer.flush_broadcast()
    assert [dtype for _, dtype, _ in fake.pinned] == [torch.float32, torch.bfloat16]
    for key, value in trainer.policy.state_dict().items():
        assert torch.equal(bits(manager.sent[-1][1][key]), bits(value)), key
