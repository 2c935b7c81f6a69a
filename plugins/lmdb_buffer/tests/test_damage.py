"""A resumed store whose shard was truncated or garbled is refused, naming the shard and the way out;
a healthy one opens with every record.

Each store is populated by real writes, closed, then one shard's ``data.mdb`` is damaged the way the
issue-28 trials did. The resumed open runs in a forked child: were the verification to miss a
truncation, LMDB would kill the opener with SIGBUS, and that must end the child, never pytest.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import shutil
import signal

import pytest

from mineonline_core.testing.store_conformance import assert_tree_equal, sample_payload
from mineonline_lmdb import LMDBStore, StoreDamagedError
from mineonline_lmdb.verify import MANIFEST, read_manifest

SHARDS = 2
KEYS = [f"0.{i % 3}.{i % 2}.{i:09d}" for i in range(40)]


def _populate(path: str) -> dict[str, dict]:
    payloads = {key: sample_payload(i, side=24) for i, key in enumerate(KEYS)}
    store = LMDBStore(path=path, num_shards=SHARDS, resume=False)
    try:
        for start in range(0, len(KEYS), 8):  # several transactions, as a run writes
            store.put_many((k, payloads[k]) for k in KEYS[start : start + 8])
        store.delete(KEYS[0])  # evicted before the restart
    finally:
        store.close()
    del payloads[KEYS[0]]
    return payloads


def _damage(data: str, how: str) -> None:
    size = os.path.getsize(data)
    if how == "truncated to 0":
        os.truncate(data, 0)
    elif how == "truncated to 8 KB":
        os.truncate(data, 8192)
    elif how == "truncated to half":
        os.truncate(data, size // 2)
    else:  # 4 random pages (not the two meta pages) overwritten with random bytes
        rng = random.Random(0)
        with open(data, "r+b") as f:
            for page in rng.sample(range(2, size // 4096), 4):
                f.seek(page * 4096)
                f.write(rng.randbytes(4096))


def _open_in_child(path: str, conn) -> None:
    try:
        store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
        conn.send(("opened", store.size()))
        store.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send((type(exc).__name__, str(exc)))


def _resume(path: str) -> tuple[str, object]:
    """Open the store with resume in a forked child; what it said, or how it died."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_open_in_child, args=(path, child), daemon=True)
    proc.start()
    try:
        got = parent.recv() if parent.poll(120) else None
    finally:
        proc.join(timeout=60)
        parent.close()
    if got is None:
        return "died", signal.Signals(-proc.exitcode).name if proc.exitcode and proc.exitcode < 0 else proc.exitcode
    return got


@pytest.mark.parametrize(
    "how", ["truncated to 0", "truncated to 8 KB", "truncated to half", "4 random pages corrupted"]
)
def test_a_damaged_shard_is_refused_naming_it_and_the_way_out(tmp_path, how):
    path = str(tmp_path / "replay")
    kept = _populate(path)
    shard = os.path.join(path, "shard-000")
    manifest = read_manifest(shard)
    assert manifest is not None and manifest["records"] > 0  # written as the store wrote
    _damage(os.path.join(shard, "data.mdb"), how)

    what, message = _resume(path)
    assert what == StoreDamagedError.__name__, (what, message)
    assert f"shard {shard}:" in message and "shard-001" not in message, message
    assert f"rm -r '{shard}'" in message and f"remove {path!r}" in message, message
    assert "\n" not in message
    print(f"FIGURE {how}: {message}")

    # The way out the message gives: without the damaged shard, the other shard's records are all there.
    shutil.rmtree(shard)
    store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
    try:
        found = set(store.keys())
        survivors = {k: p for k, p in kept.items() if k in found}
        assert survivors and len(survivors) == len(found) < len(kept)
        for key, got in zip(survivors, store.get_many(list(survivors))):
            assert_tree_equal(got, kept[key], key)
    finally:
        store.close()


def test_a_healthy_store_opens_with_every_record(tmp_path):
    path = str(tmp_path / "replay")
    kept = _populate(path)
    assert _resume(path) == ("opened", len(kept))
    store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
    try:
        assert sorted(store.keys()) == sorted(kept)
        for key, got in zip(kept, store.get_many(list(kept))):
            assert_tree_equal(got, kept[key], key)
        store.put("after", {"x": 1})
    finally:
        store.close()
    assert sum(read_manifest(os.path.join(path, f"shard-{i:03d}"))["records"] for i in range(SHARDS)) == len(kept) + 1


def test_a_removed_shard_starts_empty_with_a_warning(tmp_path, caplog):
    path = str(tmp_path / "replay")
    _populate(path)
    shutil.rmtree(os.path.join(path, "shard-001"))
    with caplog.at_level(logging.WARNING, logger="mineonline"):
        store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
    store.close()
    assert f"{os.path.join(path, 'shard-001')} missing" in caplog.text
    assert os.path.exists(os.path.join(path, "shard-000", MANIFEST))
