"""A store whose bytes were changed by someone else: a clear error, never code execution."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from mineonline_lmdb import CorruptRecordError, LMDBStore
from mineonline_lmdb import codec


class _Trap:
    """Unpickling this creates a file: the test fails if the store ever unpickles a value."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (Path.touch, (self.canary,))


def _header(tree, parts: int, values: list | None = None, values_text: bytes | None = None) -> bytes:
    structure = json.dumps(tree).encode()
    scalars = values_text if values_text is not None else json.dumps(values or []).encode()
    head = struct.pack("<4sIII", b"MOL3", parts, len(structure), len(scalars)) + structure + scalars
    return head + bytes(-len(head) % 8)


def _raw_header(parts: int, structure: bytes) -> bytes:
    return struct.pack("<4sIII", b"MOL3", parts, len(structure), 0) + structure


BIG = ["a", "<f4", [8192], 0, 0]  # the victim's large array, stored as part 0


def _tamper(path: str, key: str, *, header: bytes | None = None, part: tuple[int, bytes | None] | None = None) -> None:
    """Rewrite one record with raw LMDB while no store has the path open (one shard)."""
    env = lmdb.open(f"{path}/shard-000", max_dbs=2)
    try:
        meta, parts = env.open_db(b"meta"), env.open_db(b"parts")
        with env.begin(write=True) as txn:
            if header is not None:
                txn.put(key.encode(), header, db=meta)
            if part is not None:
                index, value = part
                part_key = key.encode() + b"\x00" + index.to_bytes(4, "big")
                txn.delete(part_key, db=parts) if value is None else txn.put(part_key, value, db=parts)
    finally:
        env.close()


CASES = {
    "pickle instead of a header": lambda canary: {"header": pickle.dumps(_Trap(canary))},
    "pickle behind our magic": lambda canary: {"header": _raw_header(1, pickle.dumps(_Trap(canary)))},
    "object dtype": lambda canary: {
        "header": _header(["a", "|O", [1], 0, 0], 1),
        "part": (0, pickle.dumps(_Trap(canary))),
    },
    "shape larger than the buffer": lambda canary: {"header": _header(["a", "<f4", [1000, 1000], 0, 0], 1)},
    "truncated part": lambda canary: {"part": (0, b"\x00" * 7)},
    "missing part": lambda canary: {"part": (0, None)},
    "part index out of range": lambda canary: {"header": _header(["a", "<f4", [8192], 5, 0], 1)},
    "inline array outside the blob": lambda canary: {"header": _header(["d", ["x"], [["A", "<f4", [4], 0, 0]]], 0)},
    "misaligned inline array": lambda canary: {"header": _header(["A", "<f4", [1], 3, 0], 0) + bytes(16)},
    "huge shape": lambda canary: {"header": _header(["A", "<f8", [2**40, 2**20], 0, 0], 0) + bytes(64)},
    "unknown tag": lambda canary: {"header": _header(["eval", "__import__('os')"], 0)},
    "nesting bomb": lambda canary: {"header": _raw_header(0, b"[" * 100_000 + b"]" * 100_000)},
    "structured dtype": lambda canary: {"header": _header(["a", "[('a', '<i4')]", [1], 0, 0], 1)},
    "json length beyond the value": lambda canary: {"header": struct.pack("<4sIII", b"MOL3", 1, 10**6, 0) + b"[]"},
    "pickle as the values": lambda canary: {"header": _header(["v"], 0, values_text=pickle.dumps(_Trap(canary)))},
    "value of a wrong type": lambda canary: {"header": _header(["v"], 0, values=[{"__reduce__": "os.system"}])},
    "fewer values than the structure needs": lambda canary: {"header": _header(["l", [["v"], ["v"]]], 0, values=[1])},
    "bad hex float": lambda canary: {"header": _header(["v"], 0, values=[["0xzz"]])},
    "blob shorter than its arrays": lambda canary: {"header": _header(["A", "<f8", [100], 0, 0], 0) + bytes(8)},
    "truncated header": lambda canary: {"header": b"MOL"},
    "garbage": lambda canary: {"header": bytes(range(256))},
    "absurd part count": lambda canary: {"header": _header(BIG, 2**32 - 1)},
}


def _victim_and_bystander(path: str) -> LMDBStore:
    store = LMDBStore(path=path, num_shards=1, resume=False)
    store.put("victim", {"x": np.arange(8192, dtype=np.float32), "small": np.arange(4)})  # a part and an inline array
    store.put("bystander", {"y": np.arange(3)})
    return store


@pytest.mark.parametrize("case", sorted(CASES))
def test_tampered_record_is_dropped_at_the_open_named_and_counted(tmp_path, case, caplog):
    """The open of a resumed store checks every record: an undecodable one is dropped with a warning and
    counted (``corrupt_records``), the others kept; nothing stored is ever executed."""
    path, canary = str(tmp_path / "s"), tmp_path / "canary"
    _victim_and_bystander(path).close()
    _tamper(path, "victim", **CASES[case](canary))

    store = LMDBStore(path=path, num_shards=1, resume=True)
    try:
        assert not canary.exists(), "the store executed code from a stored value"
        assert store.keys() == ["bystander"] and store.corrupt_records == 1
        assert "record 'victim'" in caplog.text and "dropped at open" in caplog.text
        with pytest.raises(KeyError):
            store.get("victim")
        assert np.array_equal(store.get("bystander")["y"], np.arange(3))  # one bad record spoils nothing else
    finally:
        store.close()
    reopened = LMDBStore(path=path, num_shards=1, resume=True)  # the drop was committed
    assert reopened.keys() == ["bystander"] and reopened.corrupt_records == 0
    reopened.close()


@pytest.mark.parametrize("case", ["garbage", "missing part", "truncated part", "pickle behind our magic"])
def test_tampered_record_at_a_read_is_a_clear_error_and_dropped(tmp_path, case, caplog):
    """A record damaged after the open (here by another process): the read raises ``CorruptRecordError``
    naming it, and the store drops it, with a warning and ``corrupt_records``, so that no later read
    stops on it."""
    path, canary = str(tmp_path / "s"), tmp_path / "canary"
    store = _victim_and_bystander(path)
    try:
        tamper = f"import test_tamper as t; t._tamper({path!r}, 'victim', **t.CASES[{case!r}](t.Path({str(canary)!r})))"
        subprocess.run([sys.executable, "-c", tamper], cwd=Path(__file__).parent, check=True)
        with pytest.raises(CorruptRecordError, match="'victim'.*database_config.path"):
            store.get_many(["bystander", "victim"])
        assert not canary.exists(), "the store executed code from a stored value"
        assert store.keys() == ["bystander"] and store.corrupt_records == 1
        assert "record 'victim'" in caplog.text and "dropped at a read" in caplog.text
        assert [p["y"].tolist() for p in store.get_many(["bystander"])] == [[0, 1, 2]]
    finally:
        store.close()


@pytest.mark.parametrize(
    "payload, match",
    [
        ({"x": np.array([object()], dtype=object)}, "dtype"),
        ({"x": torch.zeros(2)}, "to_numpy"),
        ({1: np.zeros(1)}, "keys must be str"),
        ({"x": {1, 2}}, "set"),
    ],
)
def test_values_that_need_pickle_are_refused_on_write(tmp_path, payload, match):
    store = LMDBStore(path=str(tmp_path / "s"), num_shards=1, resume=False)
    try:
        with pytest.raises(TypeError, match=match):
            store.put("k", payload)
        assert store.size() == 0
    finally:
        store.close()


def test_records_decode_without_pickle():
    payload = {"a": np.arange(3), "big": np.ones(8192), "b": (None, 1.5, "s", b"raw")}
    header, parts = codec.encode(payload)
    assert header.startswith(b"MOL3") and len(parts) == 2  # the large array and the bytes leaf
    parsed = codec.parse_header(header)  # the structure and the values are plain JSON
    tree = parsed.plan.tree
    assert parsed.values == [1.5, "s"]
    assert tree[0] == "d" and tree[1] == ["a", "big", "b"]
    got = codec.decode(header, [codec.raw_view(p) for p in parts])
    assert np.array_equal(got["a"], np.arange(3)) and np.array_equal(got["big"], np.ones(8192))
    assert got["b"] == (None, 1.5, "s", b"raw")
