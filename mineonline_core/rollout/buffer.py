"""``ReplayBuffer``: chunk bookkeeping over fragments whose payloads live in the FragmentStore.

The buffer holds only keys and small metadata; workers write payloads to the store and then
announce them with ``add_fragment``; the trainer reads payloads from the store itself, so no payload
is ever copied through this actor. Rules:

* ``fragments_per_chunk`` consecutive fragments of one stream form a chunk; a gap in ``index`` (a
  lost or stale fragment) drops the pending partial chunk, so a chunk is always contiguous in time.
* at most ``max_chunks`` chunks; the oldest are evicted first.
* a chunk is served at most ``max_reuse`` times, freshest first (least reused among equals).
* ranks of one iteration train on disjoint chunks while enough eligible ones exist: each rank
  samples on its own, naming the iteration (``round_id``), and a chunk not yet served in that round
  comes before any that was, so with ``max_reuse >= 2`` a rank never gets the chunks another rank
  just took while unserved ones wait (that would count them twice in the all-reduced gradient).
  The round is the iteration, not the version: warm-up iterations do not bump the version.
* a chunk older than ``max_staleness`` versions is never served: checked at add, at every
  ``set_version`` over *all* chunks, and at sample.
* payloads of dropped chunks are deleted from the store, but only once no trainer is still
  reading them (``release``), so the store stays bounded and readers never see a hole.
* once the run is asked to stop (``stop_waiting``, from the manager's ``request_stop``), a trainer
  waiting for chunks is released at once with ``SampleStopped`` instead of waiting on: rollout may
  be hours from the next chunk (a long ``fragment_length``), and a stop must not wait for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mineonline_core.contracts.fragment import fragment_checksum, fragment_key, parse_fragment_key
from mineonline_core.errors import ConfigError, SampleStopped, SampleTimeout
from mineonline_core.services.runlog import setup_actor_logging

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.services.handles import StoreAccess
    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)


@dataclass
class _Chunk:
    chunk_id: str
    keys: list[str]
    version: int
    checksums: list[int]
    nbytes: int
    seq: int
    reuse: int = 0
    readers: int = 0  # handed out and not yet released
    # The rounds it was served in (at most max_reuse): a set, not the last one, because a rank's
    # prefetch for round j+1 may run before another rank's fetch for round j.
    rounds: set[int] = field(default_factory=set)
    dropped: bool = False  # no longer servable; payloads go once readers == 0


@dataclass
class _Pending:
    metas: list[dict] = field(default_factory=list)


class ReplayBuffer:
    """Async Ray actor (one event loop: no locks needed). See the module docstring."""

    def __init__(
        self,
        *,
        store_client: StoreAccess,
        max_chunks: int,
        max_reuse: int,
        max_staleness: int,
        fragments_per_chunk: int = 1,
        fragments_per_report: int = 40,
        logger_hub: ActorHandle[LoggerHub] | None = None,
        version: int = 0,
    ) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        self._store = store_client
        self.max_chunks, self.max_reuse, self.max_staleness = max_chunks, max_reuse, max_staleness
        self.fragments_per_chunk, self.fragments_per_report = fragments_per_chunk, fragments_per_report
        self._hub = logger_hub
        self.version = version
        self._chunks: dict[str, _Chunk] = {}  # servable, in insertion order (oldest first)
        self._draining: dict[str, _Chunk] = {}  # dropped but still being read
        self._pending: dict[str, _Pending] = {}
        self._missing_workers: list[str] = []  # why no fragment comes from some workers (set_missing_workers)
        self._seq = itertools.count()
        self._cond: asyncio.Condition | None = None
        self._stopping = False
        self._since_report = 0
        self.counters = {
            "fragments_added": 0,
            "dropped_stale": 0,
            "dropped_gap": 0,
            "evicted": 0,
            "used_up": 0,
            "chunks_served": 0,
            "deleted_keys": 0,
        }

    def _condition(self) -> asyncio.Condition:
        # Created lazily: it must belong to the actor's event loop, which __init__ does not run on.
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    # -- producers ----------------------------------------------------------------------------

    async def add_fragment(self, meta: dict) -> None:
        """Index a fragment whose payload is already in the store (``meta``: ``contracts.fragment.fragment_meta``)."""
        await self.add_fragments([meta])

    async def add_fragments(self, metas: list[dict]) -> None:
        """Index several fragments in one call (in order): what a worker's send thread does when
        fragments queued up faster than one call each could announce them."""
        doomed: list[str] = []
        added = False
        for meta in metas:
            added |= self._index(meta, doomed)
        if added:
            async with self._condition():
                self._condition().notify_all()
        await self._delete(doomed)
        self._since_report += len(metas)
        if self._since_report >= self.fragments_per_report:
            self._since_report = 0
            self._report()

    def _index(self, meta: dict, doomed: list[str]) -> bool:
        """Account one fragment; appends keys to delete to ``doomed``; True when a chunk completed."""
        self.counters["fragments_added"] += 1
        stream, index, version = meta["stream"], int(meta["index"]), int(meta["version"])
        pending = self._pending.setdefault(stream, _Pending())
        if pending.metas and int(pending.metas[-1]["index"]) + 1 != index:
            doomed += [m["key"] for m in pending.metas]  # a gap: the partial chunk can never complete
            self.counters["dropped_gap"] += len(pending.metas)
            pending.metas = []
        if self._stale(version):
            doomed += [meta["key"]] + [m["key"] for m in pending.metas]
            self.counters["dropped_stale"] += 1 + len(pending.metas)
            pending.metas = []
            return False
        pending.metas.append(meta)
        if len(pending.metas) < self.fragments_per_chunk:
            return False
        self._new_chunk(pending.metas)
        pending.metas = []
        while len(self._chunks) > self.max_chunks:
            oldest = next(iter(self._chunks.values()))
            self.counters["evicted"] += 1
            doomed += self._drop(oldest)
        return True

    def _new_chunk(self, metas: list[dict]) -> None:
        chunk = _Chunk(
            chunk_id=fragment_key(metas[0]["stream"], int(metas[0]["index"])),
            keys=[m["key"] for m in metas],
            version=min(int(m["version"]) for m in metas),
            checksums=[int(m.get("checksum", 0)) for m in metas],
            nbytes=sum(int(m.get("nbytes", 0)) for m in metas),
            seq=next(self._seq),
        )
        self._chunks[chunk.chunk_id] = chunk

    async def set_version(self, version: int) -> None:
        """The trainer published ``version``: drop every chunk (not just the oldest) now too stale."""
        self.version = int(version)
        doomed: list[str] = []
        for chunk in [c for c in self._chunks.values() if self._stale(c.version)]:
            self.counters["dropped_stale"] += len(chunk.keys)
            doomed += self._drop(chunk)
        for pending in self._pending.values():
            if pending.metas and self._stale(min(int(m["version"]) for m in pending.metas)):
                self.counters["dropped_stale"] += len(pending.metas)
                doomed += [m["key"] for m in pending.metas]
                pending.metas = []
        await self._delete(doomed)

    # -- the trainer --------------------------------------------------------------------------

    async def sample(
        self,
        num_chunks: int,
        for_version: int | None = None,
        timeout: float | None = None,
        *,
        round_id: int | None = None,
    ) -> list[dict]:
        """Wait until ``num_chunks`` chunks are eligible, then serve the freshest (least reused first).

        ``for_version``: the version the trainer will train these chunks at, when it fetches ahead of
        its own broadcast; staleness is then judged against it, so prefetching never trains on a chunk
        more than ``max_staleness`` versions old. ``timeout``: seconds to wait at most, then raise
        ``SampleTimeout`` with ``explain``'s account of why no chunk is eligible. ``round_id``: the
        training iteration these chunks are for; chunks not yet served in that round come first (then
        freshest, least reused), so the ranks of one iteration get disjoint chunks whenever enough are
        eligible, and overlap (least reused first) only when not. None: no round (one consumer)."""
        if num_chunks > self.max_chunks:
            raise ConfigError(
                f"The trainer asks for {num_chunks} chunks per iteration but the replay buffer holds at most "
                f"rollout_config.replay_buffer_config.max_chunks={self.max_chunks}; raise max_chunks or lower "
                f"train_config.batches_per_iteration * batch_size_per_gpu."
            )
        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(
                    cond.wait_for(lambda: self._stopping or self._num_eligible(for_version) >= num_chunks), timeout
                )
            except asyncio.TimeoutError:
                raise SampleTimeout(f"after {timeout:.0f}s: {self.explain(num_chunks, for_version)}") from None
            if self._num_eligible(for_version) < num_chunks:
                raise SampleStopped(f"the run is stopping; {self.explain(num_chunks, for_version)}")
            eligible = [c for c in self._chunks.values() if self._eligible(c, for_version)]
            eligible.sort(key=lambda c: (round_id in c.rounds, -c.version, c.reuse, c.seq))
            served = eligible[:num_chunks]
        out = []
        for chunk in served:
            chunk.reuse += 1
            if round_id is not None:
                chunk.rounds.add(round_id)
            chunk.readers += 1
            out.append(
                {
                    "chunk_id": chunk.chunk_id,
                    "keys": list(chunk.keys),
                    "version": chunk.version,
                    "reuse": chunk.reuse,
                    "checksums": list(chunk.checksums),
                }
            )
            if chunk.reuse >= self.max_reuse:
                self.counters["used_up"] += 1
                self._drop(chunk)  # payloads stay until released
        self.counters["chunks_served"] += len(out)
        return out

    async def stop_waiting(self) -> None:
        """The run stops: every ``sample`` waiting now or later without enough chunks raises ``SampleStopped``."""
        self._stopping = True
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def release(self, chunk_ids: list[str]) -> None:
        """The trainer holds the payloads of ``chunk_ids`` now: dropped ones may be deleted."""
        doomed: list[str] = []
        for chunk_id in chunk_ids:
            chunk = self._chunks.get(chunk_id) or self._draining.get(chunk_id)
            if chunk is None or chunk.readers == 0:
                continue
            chunk.readers -= 1
            if chunk.dropped and chunk.readers == 0:
                del self._draining[chunk_id]
                doomed += chunk.keys
        await self._delete(doomed)

    def explain(self, num_chunks: int, for_version: int | None = None) -> str:
        """Why fewer than ``num_chunks`` chunks are eligible now, with the key that governs each reason."""
        at = max(self.version, for_version or 0)
        chunks = list(self._chunks.values())
        stale = sum(1 for c in chunks if self._stale(c.version, for_version))
        used = sum(1 for c in chunks if c.reuse >= self.max_reuse)
        partial = sum(len(p.metas) for p in self._pending.values())
        text = (
            f"{self._num_eligible(for_version)} of the {num_chunks} chunks asked for are eligible at model version "
            f"{at}; "
            f"the buffer holds {len(chunks)} chunks ({stale} too stale for max_staleness={self.max_staleness}, {used} "
            f"used up by max_reuse={self.max_reuse}), {partial} fragments wait in partial chunks of "
            f"fragments_per_chunk={self.fragments_per_chunk}, {self.counters['fragments_added']} fragments received "
            f"in all ({self.counters['dropped_stale']} dropped stale, {self.counters['dropped_gap']} dropped at gaps)"
        )
        if self._missing_workers:  # the manager's account: a hung or dead worker, not a slow rollout side
            return text + ". No fragment comes from: " + "; ".join(self._missing_workers)
        if not self.counters["fragments_added"]:
            return text + ". No rollout worker delivered a fragment: see the rollout workers' errors."
        if stale and stale >= len(chunks) // 2:
            return text + ". Most data is too old: raise rollout_config.replay_buffer_config.max_staleness."
        return text + ". Rollout is slower than training: add rollout workers or envs, or raise max_reuse."

    def set_missing_workers(self, why: list[str]) -> None:
        """The manager's lines for the rollout workers from which no fragment comes now (hung, dead),
        named by ``explain`` instead of its advice; empty when every worker is reporting."""
        self._missing_workers = list(why)

    def stats(self) -> dict[str, float]:
        chunks = list(self._chunks.values())
        n = len(chunks)
        return {
            "replay/size": float(n),
            "replay/chunks_draining": float(len(self._draining)),
            "replay/staleness_mean": sum(self.version - c.version for c in chunks) / n if n else 0.0,
            "replay/reuse_mean": sum(c.reuse for c in chunks) / n if n else 0.0,
            "replay/bytes": float(sum(c.nbytes for c in chunks) + sum(c.nbytes for c in self._draining.values())),
            "replay/version": float(self.version),
            **{f"replay/{k}": float(v) for k, v in self.counters.items()},
        }

    async def rebuild_from_store(self) -> int:
        """Resume: rebuild the index from the store's keys; stale or incomplete data is deleted.

        Versions and checksums are read from the payloads themselves (the keys carry only stream
        and index). Returns the number of chunks rebuilt.
        """
        keys = await asyncio.to_thread(self._store.keys)
        by_stream: dict[str, list[tuple[int, str]]] = {}
        for key in keys:
            parsed = parse_fragment_key(key)
            if parsed is not None:
                by_stream.setdefault(parsed[0], []).append((parsed[1], key))
        rebuilt = 0
        for stream, items in sorted(by_stream.items()):
            for index, key in sorted(items):
                (payload,) = await asyncio.to_thread(self._store.get_many, [key])
                meta = {
                    "key": key,
                    "stream": stream,
                    "index": index,
                    "version": int(payload["version"].min()),
                    "steps": len(payload["reward"]),
                    "checksum": fragment_checksum(key, payload),
                }
                before = len(self._chunks)
                await self.add_fragment(meta)
                rebuilt += len(self._chunks) - before
        for pending in self._pending.values():  # trailing partial chunks cannot complete after a restart
            await self._delete([m["key"] for m in pending.metas])
            pending.metas = []
        return rebuilt

    # -- helpers ------------------------------------------------------------------------------

    def _stale(self, version: int, at: int | None = None) -> bool:
        return max(self.version, at or 0) - version > self.max_staleness

    def _eligible(self, chunk: _Chunk, at: int | None = None) -> bool:
        return chunk.reuse < self.max_reuse and not self._stale(chunk.version, at)

    def _num_eligible(self, at: int | None = None) -> int:
        return sum(1 for c in self._chunks.values() if self._eligible(c, at))

    def _drop(self, chunk: _Chunk) -> list[str]:
        """Make ``chunk`` unservable; returns the keys to delete now (none while it is being read)."""
        del self._chunks[chunk.chunk_id]
        chunk.dropped = True
        if chunk.readers:
            self._draining[chunk.chunk_id] = chunk
            return []
        return chunk.keys

    async def _delete(self, keys: list[str]) -> None:
        if keys:
            self.counters["deleted_keys"] += len(keys)
            # Off the event loop: a store call blocks, and sample/add must keep being served.
            await asyncio.to_thread(self._store.delete_many, keys)

    def _report(self) -> None:
        if self._hub is not None:
            self._hub.log_metrics.remote(self.stats())  # fire and forget: never block on logging
