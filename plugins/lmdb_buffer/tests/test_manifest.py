"""A resumed store's shards are checked against their manifests (``verify.py``), and what a garbled record
payload does on its way back to the trainer.

* A shard whose records differ from the count its manifest vouches for at the same transaction, a shard
  rolled back to an older transaction than its manifest's, and a shard whose data file is gone while its
  manifest vouches for records are each refused with ``StoreDamagedError`` naming the shard and what was
  found. (Truncations and garbled pages: ``test_damage.py``.)
* 4 XORed bytes inside a stored fragment's column (reward, log-prob, version) read back different, and
  the checksums written with the record (``contracts.fragment.seal``, through ``fragment_meta`` as the
  rollout worker writes) refuse it at read (``contracts.fragment.verify_fragment``, which the trainer
  runs at fetch, ``trainer/fetch.py``), naming the column. A record of a store written before records
  carried checksums is still read and checked by the old rule (key, rewards, log-probs).
"""

from __future__ import annotations

import json
import os
import shutil

import lmdb
import numpy as np
import pytest
from mineonline_lmdb import LMDBStore, StoreDamagedError
from mineonline_lmdb.verify import MANIFEST, read_manifest

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.fragment import fragment_checksum, fragment_key
from mineonline_core.testing import kit as tk

SHARDS = 1


def _fragments(*, sealed: bool = True) -> list[dict]:
    streams = tk.rollout_fragments(
        tk.TinyMLPPolicy(), lambda i: tk.time_limited_counting(i, limit=5), num_envs=2, fragment_length=8
    )
    fragments = [frag for frags in streams.values() for frag in frags]
    for n, frag in enumerate(fragments):  # versions whose bytes occur once in a record, so they can be found
        frag[F.VERSION] = 1_000_003 + 7919 * np.arange(len(frag[F.VERSION]), dtype=np.int64) + 100_000 * n
        if sealed:
            F.seal(frag)  # as ``fragment_meta`` seals what a rollout worker writes
    return fragments


def _populate(path: str, fragments: list[dict], *, batches: int = 4) -> dict[str, dict]:
    kept = {fragment_key(f[F.STREAM], f[F.INDEX]): f for f in fragments}
    store = LMDBStore(path=path, num_shards=SHARDS, resume=False)
    try:
        items = list(kept.items())
        step = max(len(items) // batches, 1)
        for start in range(0, len(items), step):  # several transactions, as a run writes
            store.put_many(items[start : start + step])
    finally:
        store.close()
    return kept


def _refused(path: str) -> str:
    with pytest.raises(StoreDamagedError) as info:
        LMDBStore(path=path, num_shards=SHARDS, resume=True).close()
    message = str(info.value)
    shard = os.path.join(path, "shard-000")
    assert f"shard {shard}:" in message and f"rm -r '{shard}'" in message, message
    return message


def test_a_shard_holding_other_records_than_its_manifest_says_is_refused(tmp_path):
    path = str(tmp_path / "replay")
    kept = _populate(path, _fragments())
    shard = os.path.join(path, "shard-000")
    manifest = read_manifest(shard)
    assert manifest == {"txnid": manifest["txnid"], "records": len(kept)}
    # The manifest of the same transaction vouches for one record more than the file holds.
    with open(os.path.join(shard, MANIFEST), "w") as f:
        json.dump({"txnid": manifest["txnid"], "records": len(kept) + 1}, f)
    message = _refused(path)
    assert f"it holds {len(kept)} records at transaction {manifest['txnid']}" in message, message
    assert f"its manifest says {len(kept) + 1} records" in message, message


def test_a_shard_rolled_back_to_an_older_transaction_is_refused(tmp_path):
    path = str(tmp_path / "replay")
    fragments = _fragments()
    _populate(path, fragments[:2], batches=1)
    shard = os.path.join(path, "shard-000")
    older = tmp_path / "older.mdb"
    shutil.copyfile(os.path.join(shard, "data.mdb"), older)
    store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
    try:
        store.put_many((fragment_key(f[F.STREAM], f[F.INDEX]), f) for f in fragments[2:])
    finally:
        store.close()
    committed = read_manifest(shard)["txnid"]
    shutil.copyfile(older, os.path.join(shard, "data.mdb"))  # a restored backup: the later writes are gone
    message = _refused(path)
    assert f"older than the {committed} it had committed" in message, message


def test_a_missing_data_file_the_manifest_vouches_for_is_refused(tmp_path):
    path = str(tmp_path / "replay")
    kept = _populate(path, _fragments())
    os.remove(os.path.join(path, "shard-000", "data.mdb"))
    message = _refused(path)
    assert f"data.mdb is missing; its manifest says {len(kept)} records" in message, message


def _xor_inside(path: str, key: str, column: np.ndarray) -> None:
    """XOR 4 bytes in the middle of ``column``'s bytes inside ``key``'s stored record (header or parts)."""
    needle = np.ascontiguousarray(column).tobytes()
    env = lmdb.open(os.path.join(path, "shard-000"), max_dbs=2)
    try:
        meta, parts = env.open_db(b"meta"), env.open_db(b"parts")
        with env.begin(write=True) as txn:
            raw = key.encode()
            records = [(meta, raw)] + [
                (parts, k) for k, _ in txn.cursor(db=parts) if bytes(k).startswith(raw + b"\x00")
            ]
            for db, record_key in records:
                value = bytearray(txn.get(record_key, db=db))
                at = value.find(needle)
                if at >= 0 and value.find(needle, at + 1) < 0:
                    middle = at + len(needle) // 2 - 2
                    for i in range(middle, middle + 4):
                        value[i] ^= 0x5A
                    txn.put(record_key, bytes(value), db=db)
                    return
    finally:
        env.close()
    raise AssertionError(f"the bytes of the column were not found once in {key}'s record")


def _garble(tmp_path, column: str, *, sealed: bool = True) -> tuple[str, str, dict]:
    path = str(tmp_path / "replay")
    kept = _populate(path, _fragments(sealed=sealed))
    key, frag = next(iter(kept.items()))
    _xor_inside(path, key, frag[column])
    return path, key, frag


def _read(path: str, key: str) -> dict:
    store = LMDBStore(path=path, num_shards=SHARDS, resume=True)
    try:
        (got,) = store.get_many([key])
    finally:
        store.close()
    return got


def test_garbled_reward_bytes_fail_the_fragment_checksum_the_trainer_checks(tmp_path):
    # Unsealed, as a store written before record checksums: the old rule (key, rewards, log-probs) still holds.
    path, key, frag = _garble(tmp_path, F.REWARD, sealed=False)
    got = _read(path, key)
    assert not np.array_equal(got[F.REWARD], frag[F.REWARD])  # the garbling reached the payload
    assert fragment_checksum(key, got) != fragment_checksum(key, frag)


@pytest.mark.parametrize("column", [F.VERSION, F.REWARD, F.LOGPROB])
def test_garbled_version_bytes_are_refused_at_read(tmp_path, column):
    """A record read back must be the record written, or be refused (the name is the issue's, for version)."""
    path, key, frag = _garble(tmp_path, column)
    got = _read(path, key)
    assert not np.array_equal(got[column], frag[column])  # the garbling reached the payload
    problems = F.verify_fragment(key, got, checksum=fragment_checksum(key, frag))
    assert problems and f"column(s) {column} differ from the checksums written with them" in problems[0], problems


def test_a_record_written_before_record_checksums_is_read_and_checked_by_the_old_rule(tmp_path):
    """Resuming a store written by an older version: its records have no checksum column, and still read back
    and pass; a garbled reward in one is still refused (the old rule: key, rewards, log-probs)."""
    path = str(tmp_path / "replay")
    kept = _populate(path, _fragments(sealed=False))
    (key, frag), (other, _) = list(kept.items())[:2]
    got = _read(path, other)
    assert F.CHECKSUM not in got and F.verify_fragment(other, got, checksum=fragment_checksum(other, got)) == []
    expected = fragment_checksum(key, frag)
    _xor_inside(path, key, frag[F.REWARD])
    problems = F.verify_fragment(key, _read(path, key), checksum=expected)
    assert problems == ["its checksum differs from the one its writer reported"], problems
