"""ReplayBuffer rules on a real in-memory store: chunking, eviction, reuse, staleness, deferred
deletion, waiting samples and rebuild from the store."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mineonline_core.contracts import fragment as F
from mineonline_core.errors import ConfigError
from mineonline_core.rollout.buffer import ReplayBuffer
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.contracts.store import MemoryStore


def make_fragment(stream: str, index: int, version: int, T: int = 4) -> dict:
    return {
        F.STREAM: stream,
        F.INDEX: index,
        F.VERSION: np.full(T, version, np.int64),
        F.REWARD: np.arange(T, dtype=np.float32) + index,
        F.LOGPROB: np.zeros(T, np.float32),
    }


class Harness:
    """A buffer over a MemoryStore; ``add`` writes the payload first, as a worker does."""

    def __init__(self, **kwargs) -> None:
        self.store = MemoryStore(path="unused")
        defaults = dict(max_chunks=100, max_reuse=1, max_staleness=10, fragments_per_chunk=1, fragments_per_report=1000)
        self.buffer = ReplayBuffer(store_client=self.store, **{**defaults, **kwargs})

    async def add(self, stream: str, index: int, version: int = 0) -> dict:
        frag = make_fragment(stream, index, version)
        meta = fragment_meta(frag)
        self.store.put(meta["key"], frag)
        await self.buffer.add_fragment(meta)
        return meta


def run(coro):
    return asyncio.run(coro)


def test_chunks_group_consecutive_fragments_and_a_gap_drops_the_partial_chunk() -> None:
    async def go():
        h = Harness(fragments_per_chunk=3)
        for i in range(3):
            await h.add("0.0.0", i)
        await h.add("0.0.1", 0)
        await h.add("0.0.1", 1)
        await h.add("0.0.1", 3)  # index 2 lost: fragments 0 and 1 can never form a chunk
        for i in (4, 5):
            await h.add("0.0.1", i)
        chunks = await h.buffer.sample(2)
        return h, chunks

    h, chunks = run(go())
    by_id = {c["chunk_id"]: c for c in chunks}
    assert set(by_id) == {"0.0.0.000000000", "0.0.1.000000003"}
    assert by_id["0.0.0.000000000"]["keys"] == [F.fragment_key("0.0.0", i) for i in range(3)]
    assert by_id["0.0.1.000000003"]["keys"] == [F.fragment_key("0.0.1", i) for i in (3, 4, 5)]
    assert h.buffer.counters["dropped_gap"] == 2
    assert sorted(h.store.keys()) == sorted(k for c in chunks for k in c["keys"])  # the orphans are gone


def test_max_chunks_evicts_the_oldest_and_deletes_their_payloads() -> None:
    async def go():
        h = Harness(max_chunks=3)
        for i in range(5):
            await h.add("s", i)
        return h

    h = run(go())
    stats = h.buffer.stats()
    assert stats["replay/size"] == 3 and stats["replay/evicted"] == 2
    assert sorted(h.store.keys()) == [F.fragment_key("s", i) for i in (2, 3, 4)]


def test_max_reuse_and_freshest_first_least_reused_among_equals() -> None:
    async def go():
        h = Harness(max_reuse=2)
        await h.add("a", 0, version=0)
        await h.add("b", 0, version=1)
        await h.add("c", 0, version=1)
        first = await h.buffer.sample(1)
        second = await h.buffer.sample(2)
        third = await h.buffer.sample(2)
        return h, first, second, third

    h, first, second, third = run(go())
    assert [c["chunk_id"] for c in first] == ["b.000000000"]  # freshest; oldest insertion among equals
    assert [c["chunk_id"] for c in second] == ["c.000000000", "b.000000000"]  # c less reused than b
    assert [(c["chunk_id"], c["reuse"]) for c in third] == [("c.000000000", 2), ("a.000000000", 1)]
    assert h.buffer.stats()["replay/used_up"] == 2  # b and c served max_reuse times
    assert h.buffer.stats()["replay/size"] == 1


def test_ranks_of_one_round_get_disjoint_chunks_while_enough_unserved_are_eligible() -> None:
    """Issue 25's reproduction: 4 chunks of version 4 and 4 of version 5, two ranks ask for 4 each
    at version 5 in the same round. Freshest-first alone serves both the same 4 (max_reuse 2)."""

    async def go():
        h = Harness(max_reuse=2, max_staleness=1)
        await h.buffer.set_version(5)
        for i in range(4):
            await h.add(f"old{i}", 0, version=4)
            await h.add(f"new{i}", 0, version=5)
        rank0 = await h.buffer.sample(4, for_version=5, round_id=1)
        rank1 = await h.buffer.sample(4, for_version=5, round_id=1)
        next0 = await h.buffer.sample(4, for_version=5, round_id=2)  # a new round: freshest first again
        few = Harness(max_reuse=3)
        for stream, version in (("a", 0), ("b", 1), ("c", 1)):
            await few.add(stream, 0, version=version)
        few0 = await few.buffer.sample(2, round_id=1)
        few1 = await few.buffer.sample(2, round_id=1)
        return rank0, rank1, next0, few0, few1

    rank0, rank1, next0, few0, few1 = run(go())
    ids = lambda chunks: [c["chunk_id"] for c in chunks]  # noqa: E731
    assert ids(rank0) == [f"new{i}.000000000" for i in range(4)]  # freshest first
    assert ids(rank1) == [f"old{i}.000000000" for i in range(4)]  # not the chunks rank 0 just took
    assert ids(next0) == [f"new{i}.000000000" for i in range(4)]
    # Too few for both ranks: the unserved one first, then freshest, least reused, as without rounds.
    assert ids(few0) == ["b.000000000", "c.000000000"]
    assert [(c["chunk_id"], c["reuse"]) for c in few1] == [("a.000000000", 1), ("b.000000000", 2)]


def test_staleness_checked_at_add_at_every_version_bump_over_all_chunks_and_at_sample() -> None:
    async def go():
        h = Harness(max_staleness=1)
        await h.buffer.set_version(5)
        await h.add("old", 0, version=3)  # stale on arrival
        stale_at_add = h.buffer.counters["dropped_stale"]
        for stream, version in (("x", 5), ("y", 4), ("z", 5)):
            await h.add(stream, 0, version=version)
        await h.buffer.set_version(6)  # y (the middle one, not the head) is now 2 versions old
        after_bump = sorted(c.chunk_id for c in h.buffer._chunks.values())
        h.buffer.version = 7  # a version the buffer was not told about through set_version
        waiter = asyncio.create_task(h.buffer.sample(1))
        await asyncio.sleep(0.05)
        blocked = not waiter.done()
        await h.add("w", 0, version=7)
        served = await asyncio.wait_for(waiter, 5)
        return h, stale_at_add, after_bump, blocked, served

    h, stale_at_add, after_bump, blocked, served = run(go())
    assert stale_at_add == 1 and F.fragment_key("old", 0) not in h.store.keys()
    assert after_bump == ["x.000000000", "z.000000000"]
    assert F.fragment_key("y", 0) not in h.store.keys()
    assert blocked  # x and z (version 5) are stale at version 7: never served
    assert [c["chunk_id"] for c in served] == ["w.000000000"]


def test_a_prefetching_trainer_is_held_to_max_staleness_at_the_version_it_will_train_at() -> None:
    async def go():
        h = Harness(max_staleness=1, max_reuse=2)
        await h.buffer.set_version(4)
        await h.add("a", 0, version=3)
        await h.add("b", 0, version=4)
        now = await h.buffer.sample(2)  # both are fresh enough for version 4
        waiter = asyncio.create_task(h.buffer.sample(2, for_version=5))  # a is one too old for 5
        await asyncio.sleep(0.05)
        blocked = not waiter.done()
        await h.add("c", 0, version=4)
        ahead = await asyncio.wait_for(waiter, 5)
        return h, now, blocked, ahead

    h, now, blocked, ahead = run(go())
    assert sorted(c["chunk_id"] for c in now) == ["a.000000000", "b.000000000"]
    assert blocked
    assert sorted(c["chunk_id"] for c in ahead) == ["b.000000000", "c.000000000"]
    assert "a.000000000" in {c.chunk_id for c in h.buffer._chunks.values()}  # still servable at version 4


def test_a_chunk_is_as_old_as_its_oldest_fragment() -> None:
    """Weights can change between a chunk's fragments: the chunk is served with its oldest fragment's
    version and dropped as soon as that fragment is too stale, though its newest one is not."""

    async def go():
        h = Harness(max_staleness=1, max_reuse=2, fragments_per_chunk=2)
        await h.buffer.set_version(4)
        await h.add("s", 0, version=3)
        await h.add("s", 1, version=4)
        served = await h.buffer.sample(1)
        await h.buffer.release([c["chunk_id"] for c in served])
        await h.buffer.set_version(5)  # fragment 0 is 2 versions old now, fragment 1 only 1
        return h, served

    h, served = run(go())
    assert [(c["chunk_id"], c["version"]) for c in served] == [("s.000000000", 3)]
    assert h.buffer.stats()["replay/size"] == 0 and h.buffer.counters["dropped_stale"] == 2
    assert h.store.keys() == []


def test_a_fragment_is_as_old_as_its_oldest_step() -> None:
    """Weights can swap in mid-fragment: the meta a worker sends (``fragment_meta``) carries the
    oldest step's version, so the buffer drops a fragment whose first steps are too stale."""

    async def go():
        h = Harness(max_staleness=1)
        await h.buffer.set_version(5)
        frag = make_fragment("s", 0, version=4)
        frag[F.VERSION][:2] = 3  # the first two steps acted with version 3
        meta = fragment_meta(frag)
        h.store.put(meta["key"], frag)
        await h.buffer.add_fragment(meta)
        return h, meta

    h, meta = run(go())
    assert meta["version"] == 3
    assert h.buffer.counters["dropped_stale"] == 1 and h.buffer.stats()["replay/size"] == 0
    assert h.store.keys() == []


def test_add_fragments_indexes_a_batch_in_order_like_single_adds() -> None:
    async def go():
        one, many = Harness(fragments_per_chunk=2, max_chunks=2), Harness(fragments_per_chunk=2, max_chunks=2)
        metas = []
        for stream, index in (("s", 0), ("s", 1), ("t", 0), ("s", 3), ("s", 4), ("t", 1), ("s", 5), ("s", 6)):
            frag = make_fragment(stream, index, 0)
            meta = fragment_meta(frag)
            for h in (one, many):
                h.store.put(meta["key"], frag)
            await one.buffer.add_fragment(meta)
            metas.append(meta)
        await many.buffer.add_fragments(metas)
        return one, many

    one, many = run(go())
    assert list(one.buffer._chunks) == list(many.buffer._chunks) == ["t.000000000", "s.000000005"]
    assert one.buffer.counters == many.buffer.counters
    assert sorted(one.store.keys()) == sorted(many.store.keys())


def test_deletion_of_served_chunks_is_deferred_until_release() -> None:
    async def go():
        h = Harness(max_reuse=1, max_chunks=2)
        await h.add("s", 0)
        served = await h.buffer.sample(1)  # used up: deleted only after release
        held = h.store.keys()
        await h.add("s", 1)
        await h.add("s", 2)
        await h.add("s", 3)  # evicts s1 (never served): deleted at once
        before_release = sorted(h.store.keys())
        await h.buffer.release([c["chunk_id"] for c in served])
        return h, held, before_release

    h, held, before_release = run(go())
    assert F.fragment_key("s", 0) in held
    assert before_release == [F.fragment_key("s", i) for i in (0, 2, 3)]
    assert sorted(h.store.keys()) == [F.fragment_key("s", i) for i in (2, 3)]


def test_sample_waits_without_busy_waiting_then_completes() -> None:
    async def go():
        h = Harness(fragments_per_chunk=2)
        waiter = asyncio.create_task(h.buffer.sample(2))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        for i in range(4):
            await h.add("s", i)
        return await asyncio.wait_for(waiter, 5)

    chunks = run(go())
    assert [c["chunk_id"] for c in chunks] == ["s.000000000", "s.000000002"]
    assert all(len(c["keys"]) == 2 and len(c["checksums"]) == 2 for c in chunks)


def test_sample_larger_than_max_chunks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_chunks=4"):
        run(Harness(max_chunks=4).buffer.sample(5))


def test_store_stays_bounded_under_a_long_stream() -> None:
    async def go():
        h = Harness(max_chunks=8, max_reuse=2, max_staleness=1)
        sizes = []
        for i in range(200):
            await h.add(f"w{i % 3}", i // 3, version=i // 20)
            if i % 10 == 9:
                await h.buffer.set_version(i // 20)
                chunks = await h.buffer.sample(2)
                await h.buffer.release([c["chunk_id"] for c in chunks])
            sizes.append(h.store.size())
        return h, sizes

    h, sizes = run(go())
    assert max(sizes) <= 8 + 2
    assert h.store.size() == len(h.buffer._chunks)


def test_rebuild_from_store_restores_chunks_and_drops_stale_and_partial_data() -> None:
    async def go():
        old = Harness(fragments_per_chunk=2)
        for i in range(5):  # s: 2 chunks + 1 trailing fragment
            await old.add("s", i, version=3)
        await old.add("t", 0, version=0)
        await old.add("t", 1, version=0)
        fresh = ReplayBuffer(
            store_client=old.store, max_chunks=100, max_reuse=1, max_staleness=1, fragments_per_chunk=2, version=3
        )
        rebuilt = await fresh.rebuild_from_store()
        return old, fresh, rebuilt

    old, fresh, rebuilt = run(go())
    assert rebuilt == 2
    assert sorted(fresh._chunks) == ["s.000000000", "s.000000002"]
    assert sorted(old.store.keys()) == [F.fragment_key("s", i) for i in range(4)]
    chunk = fresh._chunks["s.000000000"]
    assert chunk.version == 3 and chunk.checksums[0] == fragment_meta(make_fragment("s", 0, 3))["checksum"]


def test_sample_times_out_and_says_why_no_chunk_is_eligible() -> None:
    from mineonline_core.errors import SampleTimeout

    async def go():
        h = Harness(max_staleness=1, fragments_per_chunk=2)
        with pytest.raises(SampleTimeout, match="No rollout worker delivered a fragment"):
            await h.buffer.sample(1, timeout=0.05)
        for i in range(4):
            await h.add("s", i, version=0)
        await h.add("t", 0, version=3)  # half a chunk
        await h.buffer.set_version(1)
        with pytest.raises(SampleTimeout) as slow:
            await h.buffer.sample(3, for_version=2, timeout=0.05)
        assert await h.buffer.sample(2, timeout=1.0)  # the lock is free again after a timeout
        return str(slow.value)

    message = run(go())
    assert "0 of the 3 chunks asked for are eligible at model version 2" in message
    assert "2 chunks (2 too stale for max_staleness=1" in message and "1 fragments wait in partial chunks" in message
    assert "raise rollout_config.replay_buffer_config.max_staleness" in message
