"""Fetching an iteration's chunks, ahead of time, and the per-iteration estimate over them.

The chunks of the next ``prefetch_batches`` iterations are fetched on one background thread while
the current iteration trains; each is held to ``max_staleness`` at the version it will be trained
at, and names the iteration it is for, so that the ranks of one iteration get disjoint chunks from
the buffer (``ReplayBuffer.sample``'s ``round_id``). The estimate (GAE by default) is not fetched
ahead, because it needs the updated model.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable

import ray
import torch

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.normalize import FIRST_SERVING, scale_rewards
from mineonline_core.errors import RunFailedError, SampleStopped, SampleTimeout
from mineonline_core.trainer.batch import assemble_chunks, current_policy_outputs

if TYPE_CHECKING:
    from mineonline_core.services.handles import ReplayBufferHandle, RolloutManagerHandle, StoreAccess

log = logging.getLogger(__name__)
SAMPLE_WAIT_S = 30.0  # how often a trainer waiting for chunks says why
# Refused fragments named one by one; after these, every 100th (a resume past the checkpoint refuses many).
REFUSALS_NAMED = 20


class Unreadable:
    """A stored record that could not be read, in the place of its payload: why."""

    def __init__(self, why: str) -> None:
        self.why = why


def _unreadable(payload: Any) -> list[str]:
    return [payload.why] if isinstance(payload, Unreadable) else []


class ChunkFetching:
    """``TrainLoop``'s data side: ``fetch_chunks``, prefetching, and the step that runs the ``estimate`` hook."""

    rollout_manager: RolloutManagerHandle | None
    _buffer: ReplayBufferHandle | None  # the manager's, once connected
    _store: StoreAccess | None

    def current_policy_outputs(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """The current model over whole chunks from their stored recurrent states, without
        gradients, as the update's first step runs it (``batch_size_per_gpu`` chunks at a time,
        ``self.autocast()``): ``logprob`` of the stored actions, ``vpred`` and ``value`` (N, L), and
        ``next_value`` (N,), values denormalised (``trainer.batch.current_policy_outputs``)."""
        train_config = self.train_config
        return current_policy_outputs(
            self.model,
            batch,
            context_length=train_config.context_length,
            batch_size=train_config.batch_size_per_gpu,
            autocast=self.algorithm.autocast,
        )

    def fetch_fragments_and_estimate_advantages(self, num_chunks: int) -> dict:
        """This iteration's chunks, with ``staleness`` and the ``estimate`` columns. The chunks of
        the next ``prefetch_batches`` iterations are fetched in the background while this one
        trains; the estimate is not, because it needs the updated model."""
        train_config = self.train_config
        start = time.perf_counter()
        ahead = self._prefetch
        stopped = None
        try:
            if ahead and ahead[0][:2] == (self.iteration, num_chunks):
                batch = ahead.popleft()[2].result()
            else:
                ahead.clear()  # fetched for another iteration or size; the chunks are simply not trained on
                # Judged at this rank's version, not the buffer's: after a resume the buffer starts at 0.
                batch = self.fetch_chunks(num_chunks, self.version)
        except SampleStopped as exc:
            stopped = exc
        if self._any_rank(stopped is not None):  # a rank that got its chunks must not train alone
            raise stopped or SampleStopped("another rank was waiting for chunks when the run was asked to stop")
        fetched = time.perf_counter()
        last = ahead[-1][0] if ahead else self.iteration
        for iteration in range(
            last + 1, min(self.iteration + train_config.prefetch_batches, train_config.num_iterations) + 1
        ):
            # Iteration j trains at the version the iterations before it will have published: the
            # buffer judges staleness against that, so fetching early never loosens max_staleness.
            bumps = sum(1 for k in range(self.iteration, iteration) if self.algorithm.publishes_version(k))
            ahead.append(
                (iteration, num_chunks, self._fetch_in_background(num_chunks, self.version + bumps, iteration))
            )
        batch[F.STALENESS] = (self.version - batch[F.VERSION]).float()
        # normalize_rewards: the estimate (any trainer's) sees scaled rewards; a no-op otherwise.
        batch = scale_rewards(self.policy, batch, discount=train_config.discount, gather=self.all_gather)
        batch = self.algorithm.estimate(batch=batch)
        self.perf["perf/fetch_ms"] = 1e3 * (fetched - start)  # what the loop waited for, not the fetch itself
        self.perf["perf/gae_ms"] = 1e3 * (time.perf_counter() - fetched)
        return batch

    def fetch_chunks(self, num_chunks: int, for_version: int | None = None, for_iteration: int | None = None) -> dict:
        """Sample chunks fresh enough for ``for_version`` and read their payloads straight from the
        store. ``for_iteration`` (default: the current one) is the iteration they are trained in: the
        other ranks' fetches for it get other chunks while enough are eligible. A chunk with a
        fragment that ``contracts.fragment.verify_fragment`` refuses (a column that differs from the
        checksum written with it, another key's payload, a column outside its domain at the version
        the chunk is trained at) is dropped, never trained on, and another is sampled in its place;
        each refused fragment is named once in a warning with what differed (the first
        ``REFUSALS_NAMED``, then every 100th) and counted once in ``trainer/corrupt_fragments``,
        however often the buffer serves its chunk again."""
        start = time.perf_counter()
        round_id = self.iteration if for_iteration is None else for_iteration
        at = self.version if for_version is None else for_version  # the version these chunks train at
        grouped: list[list[dict]] = []
        fresh: list[bool] = []  # served for the first time: its steps move the normalisers' statistics
        while len(grouped) < num_chunks:
            chunks = self._sample(num_chunks - len(grouped), for_version, round_id)
            payloads = self._read_payloads([key for chunk in chunks for key in chunk["keys"]])
            # Payloads are in this process now: the buffer may drop used-up or evicted ones.
            ray.get(self._buffer.release.remote([chunk["chunk_id"] for chunk in chunks]))
            offset = 0
            for chunk in chunks:
                fragments = payloads[offset : offset + len(chunk["keys"])]
                offset += len(chunk["keys"])
                bad = {
                    key: problems
                    for key, frag, crc in zip(chunk["keys"], fragments, chunk["checksums"])
                    if (problems := _unreadable(frag) or F.verify_fragment(key, frag, checksum=crc, version=at))
                }
                if bad:
                    self._refuse(chunk["chunk_id"], bad)
                    continue
                grouped.append(fragments)
                fresh.append(int(chunk.get("reuse", 1)) <= 1)
        batch = assemble_chunks(grouped, device=self.device)
        batch[FIRST_SERVING] = torch.tensor(fresh, dtype=torch.bool, device=self.device)
        self.perf["perf/fetch_chunks_ms"] = 1e3 * (time.perf_counter() - start)
        self.perf["trainer/corrupt_fragments"] = float(self.corrupt_fragments)
        self.perf["buffer/corrupt_records"] = float(self.corrupt_records)
        return batch

    def _read_payloads(self, keys: list[str]) -> list[Any]:
        """``get_many``; when it fails, key by key, so that one record that cannot be read (gone with a
        restarted in-memory store, undecodable on disk: the LMDB store drops it as it raises) costs its
        chunk only, never the fetch. Such a record is an ``Unreadable`` in the list; each undecodable one is
        counted once in ``buffer/corrupt_records``."""
        try:
            return self._store.get_many(keys)
        except Exception as exc:  # noqa: BLE001 - one bad record among many: find it below
            self._count_unreadable(exc)
        out: list[Any] = []
        for key in keys:
            try:
                out.extend(self._store.get_many([key]))
            except Exception as exc:  # noqa: BLE001 - named and counted, its chunk refused
                self._count_unreadable(exc)
                out.append(Unreadable(f"it cannot be read from the store ({type(exc).__name__}: {exc})"))
        return out

    def _count_unreadable(self, exc: BaseException) -> None:
        if not isinstance(exc, KeyError):  # absent (a restarted in-memory store) is no damage
            self.corrupt_records += 1

    def _refuse(self, chunk_id: str, bad: dict[str, list[str]]) -> None:
        # A refused chunk stays in the buffer until used up: count and name each fragment once only.
        for key, problems in bad.items():
            if key not in self._refused_keys:
                self._refused_keys.add(key)
                self.corrupt_fragments += 1
                if self.corrupt_fragments <= REFUSALS_NAMED or self.corrupt_fragments % 100 == 0:
                    log.warning(
                        "refused fragment %s (chunk %s is not trained on; %d so far, trainer/corrupt_fragments): %s",
                        key,
                        chunk_id,
                        self.corrupt_fragments,
                        "; ".join(problems),
                    )

    def _sample(self, num_chunks: int, for_version: int | None, round_id: int) -> list[dict]:
        """``buffer.sample`` in slices of ``SAMPLE_WAIT_S``: between slices the wait is logged with
        the buffer's reason and the rollout side's health checked; after ``progress_timeout`` it fails."""
        limit = float(getattr(self.config, "progress_timeout", 0.0) or 0.0)
        waited = 0.0
        while True:
            wait = SAMPLE_WAIT_S if not limit else max(min(SAMPLE_WAIT_S, limit - waited), 0.1)
            try:
                return ray.get(self._buffer.sample.remote(num_chunks, for_version, wait, round_id=round_id))
            except SampleTimeout as exc:  # Ray's wrapper is also an instance of the actor's exception
                waited += wait
                reason = str(getattr(exc, "cause", exc))
            if hasattr(self.rollout_manager, "health"):
                ray.get(self.rollout_manager.health.remote())  # a failed rollout side is the cause: raise it
            if limit and waited >= limit:
                raise RunFailedError(
                    f"trainer rank {self.rank}: no batch of {num_chunks} chunks for iteration {self.iteration + 1} "
                    f"within progress_timeout={limit:g}s: {reason}"
                )
            log.warning("trainer rank %d has waited %.0fs for %d chunks: %s", self.rank, waited, num_chunks, reason)

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (an all-reduce when there are several)."""
        if self.world_size == 1:
            return flag
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor[0] > 0)

    def _fetch_in_background(self, num_chunks: int, for_version: int, for_iteration: int) -> Future:
        if self._fetcher is None:
            self._fetcher = OrderedWorker()
        # The iteration is passed, not read there: the loop moves on while this fetch waits.
        return self._fetcher.submit(self.fetch_chunks, num_chunks, for_version, for_iteration)


class OrderedWorker:
    """One long-lived thread that runs the trainer's fetches ahead (and, as ``mineonline-broadcast``,
    its weight broadcasts, ``trainer/publish.py``), in submission order: one thread per iteration
    would churn the allocator's per-thread arenas. A daemon, because at a stop it may still be
    waiting in ``buffer.sample`` and must not hold the rank's process open."""

    def __init__(self, name: str = "mineonline-prefetch") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the loop when it takes the batch
                future.set_exception(exc)
