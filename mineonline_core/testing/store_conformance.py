"""The ``FragmentStore`` conformance suite.

A store plugin tests itself with a two-line subclass::

    class TestLMDBStore(FragmentStoreConformance):
        store_cls = LMDBStore

or, when construction needs more than ``store_cls(path=..., num_shards=..., resume=..., options=...)``,
by overriding ``make_store(self, path, *, num_shards=2, resume=False, **options)``. Every test uses a
fresh directory from pytest's ``tmp_path`` and closes what it opens.
"""

from __future__ import annotations

import struct
import threading
from typing import Any, ClassVar

import numpy as np
import pytest
from pydantic import BaseModel

from mineonline_core.contracts.store import FragmentStore


def assert_tree_equal(got: Any, want: Any, where: str = "payload") -> None:
    """Exact equality of two payload trees: container types, dtypes, shapes and bit patterns."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__} instead of ndarray"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} instead of {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {got.shape} instead of {want.shape}"
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"{where}: bits differ"
    elif isinstance(want, np.generic):
        assert type(got) is type(want), f"{where}: {type(got).__name__} instead of {type(want).__name__}"
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), f"{where}: bits differ"
    elif isinstance(want, (dict, list, tuple)):
        assert type(got) is type(want), f"{where}: {type(got).__name__} instead of {type(want).__name__}"
        if isinstance(want, dict):
            assert list(got) == list(want), f"{where}: keys {list(got)} instead of {list(want)}"
            for k in want:
                assert_tree_equal(got[k], want[k], f"{where}[{k!r}]")
        else:
            assert len(got) == len(want), f"{where}: length {len(got)} instead of {len(want)}"
            for i, (g, w) in enumerate(zip(got, want)):
                assert_tree_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert type(got) is float and struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r} != {want!r}"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} instead of {want!r}"


def sample_payload(seed: int, *, frames: int = 4, side: int = 16) -> dict[str, Any]:
    """A fragment-like tree exercising every leaf kind a store must round-trip."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((6, 8)).astype(np.float32)
    return {
        "obs": {
            "image": rng.integers(0, 256, (frames, side, side, 3), dtype=np.uint8),
            "inventory": rng.integers(-5, 5, (frames, 7), dtype=np.int64),
            "mask": rng.random((frames, 5)) > 0.5,
            "half": rng.standard_normal((frames, 3)).astype(np.float16),
        },
        "reward": rng.standard_normal(frames).astype(np.float32),
        "scalar0d": np.array(seed, dtype=np.int32),
        "npscalar": np.float64(seed + 0.25),
        "strided": wide[::2, 1::3],  # non-contiguous view
        "transposed": wide.T,
        "empty": np.zeros((0, 4), dtype=np.float32),
        "state_in": [
            (rng.standard_normal((1, 8)).astype(np.float32), None),
            (np.zeros((1, 2, 3)), np.ones((1,), bool)),
        ],
        "none": None,
        "stream": f"0.0.{seed}",
        "index": seed,
        "ratio": seed / 3.0,
        "flag": bool(seed % 2),
        "pair": (1, "a"),
    }


class FragmentStoreConformance:
    """Tests inherited by ``TestXxx`` subclasses; set ``store_cls`` or override ``make_store``."""

    store_cls: ClassVar[type[FragmentStore] | None] = None

    def make_store(self, path: str, *, num_shards: int = 2, resume: bool = False, **options: Any) -> FragmentStore:
        assert self.store_cls is not None, "set store_cls or override make_store"
        cls = self.store_cls
        return cls(path=path, num_shards=num_shards, resume=resume, options=cls.Config(**options))

    @pytest.fixture
    def store(self, tmp_path: Any) -> Any:
        store = self.make_store(str(tmp_path / "store"))
        yield store
        store.close()

    def _cls(self, store: FragmentStore) -> type[FragmentStore]:
        return type(store)

    # -- declaration -------------------------------------------------------------------------------

    def test_declares_name_config_and_flags(self, store: FragmentStore) -> None:
        cls = self._cls(store)
        assert isinstance(cls.name, str) and cls.name
        assert issubclass(cls.Config, BaseModel)
        assert cls.Config.model_config.get("extra") == "forbid"
        assert isinstance(cls.multi_process, bool) and isinstance(cls.persistent, bool)

    # -- round trips -------------------------------------------------------------------------------

    def test_round_trip_nested_tree(self, store: FragmentStore) -> None:
        payload = sample_payload(3)
        store.put("0.0.0.000000001", payload)
        assert_tree_equal(store.get("0.0.0.000000001"), payload)
        # Larger leaves too (stores may keep small and large arrays differently), one of them strided.
        large = {**sample_payload(4, side=64), "strided_large": np.arange(40_000.0)[::2], "raw": b"\x00\xff" * 9000}
        store.put("0.0.0.000000002", large)
        assert_tree_equal(store.get("0.0.0.000000002"), large)

    def test_containers_keep_their_types(self, store: FragmentStore) -> None:
        payload = {"t": (np.ones(2), [np.zeros(1), ()], ()), "l": [(), []], "d": {}, "nested": {"x": {"y": (None,)}}}
        store.put("k", payload)
        got = store.get("k")
        assert_tree_equal(got, payload)
        assert type(got["t"]) is tuple and type(got["t"][1]) is list and type(got["t"][1][1]) is tuple

    def test_special_float_bits_survive(self, store: FragmentStore) -> None:
        nan_payload = np.array([0x7FC00001], dtype=np.uint32).view(np.float32)  # a NaN with a payload
        payload = {
            "f32": np.concatenate([nan_payload, np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32)]),
            "f16": np.array([np.nan, -0.0, 65504], np.float16),
            "f64": np.array([np.finfo(np.float64).tiny, -0.0]),
            "py": [float("inf"), -0.0, 1e308],
            "big": 2**70,
        }
        store.put("bits", payload)
        assert_tree_equal(store.get("bits"), payload)

    def test_large_payload(self, store: FragmentStore) -> None:
        image = np.random.default_rng(0).integers(0, 256, (32, 128, 128, 3), dtype=np.uint8)  # 1.5 MB
        store.put("large", {"image": image})
        got = store.get("large")["image"]
        assert got.shape == image.shape and np.array_equal(got, image)

    def test_unusual_keys(self, store: FragmentStore) -> None:
        keys = ["a/b/c", "chunk:1.2.3", "ünïcødé-κλειδί", "x" * 200, "with space"]
        for i, key in enumerate(keys):
            store.put(key, {"i": np.array([i])})
        assert sorted(store.keys()) == sorted(keys)
        for i, key in enumerate(keys):
            assert int(store.get(key)["i"][0]) == i

    # -- lookup, delete, clear, size ---------------------------------------------------------------

    def test_get_missing_raises_key_error(self, store: FragmentStore) -> None:
        with pytest.raises(KeyError):
            store.get("absent")
        store.put("present", 1)
        with pytest.raises(KeyError):
            store.get_many(["present", "absent"])

    def test_delete_and_missing_delete(self, store: FragmentStore) -> None:
        store.put("a", sample_payload(1))
        store.put("b", sample_payload(2))
        store.delete("a")
        store.delete("never-there")
        assert store.keys() == ["b"] and store.size() == 1
        with pytest.raises(KeyError):
            store.get("a")
        assert_tree_equal(store.get("b"), sample_payload(2))

    def test_clear(self, store: FragmentStore) -> None:
        store.put_many((f"k{i}", sample_payload(i)) for i in range(5))
        store.clear()
        assert store.size() == 0 and store.keys() == []
        store.put("after", 7)
        assert store.get("after") == 7

    def test_size_keys_and_nbytes(self, store: FragmentStore) -> None:
        assert store.size() == 0 and store.keys() == []
        empty = store.nbytes()
        block = np.ones(1 << 20, np.uint8)
        store.put_many((f"k{i}", {"block": block}) for i in range(3))
        assert store.size() == 3 and sorted(store.keys()) == ["k0", "k1", "k2"]
        full = store.nbytes()
        assert full >= 3 * block.nbytes, f"nbytes {full} is below the 3 MiB stored"
        store.delete_many(["k0", "k1", "k2"])
        assert store.nbytes() < full - 2 * block.nbytes and store.nbytes() <= max(empty, 1 << 16)

    def test_put_many_get_many_delete_many(self, store: FragmentStore) -> None:
        payloads = {f"s.{i:09d}": sample_payload(i) for i in range(12)}
        store.put_many(payloads.items())
        order = list(reversed(payloads))
        for key, got in zip(order, store.get_many(order)):
            assert_tree_equal(got, payloads[key], key)
        store.delete_many(order[:5] + ["absent"])
        assert sorted(store.keys()) == sorted(order[5:])
        assert store.get_many([]) == []

    def test_overwrite_replaces_whole_value(self, store: FragmentStore) -> None:
        store.put("k", sample_payload(1))
        store.put("k", {"only": np.arange(3)})
        assert_tree_equal(store.get("k"), {"only": np.arange(3)})
        store.put("k", None)
        assert store.get("k") is None and store.size() == 1

    def test_one_shard(self, tmp_path: Any) -> None:
        store = self.make_store(str(tmp_path / "one"), num_shards=1)
        try:
            store.put_many((f"k{i}", i) for i in range(10))
            assert sorted(store.keys()) == sorted(f"k{i}" for i in range(10))
            assert store.get_many(["k3", "k9"]) == [3, 9]
        finally:
            store.close()

    # -- concurrency -------------------------------------------------------------------------------

    def test_concurrent_writers_and_readers(self, store: FragmentStore) -> None:
        writers, per_writer, readers = 3, 20, 3
        errors: list[BaseException] = []
        written: list[str] = []
        lock = threading.Lock()
        done = threading.Event()
        checked = [0] * readers

        def write(w: int) -> None:
            try:
                for i in range(per_writer):
                    key = f"{w}.{i}"
                    store.put(key, sample_payload(w * 1000 + i, frames=2))
                    with lock:
                        written.append(key)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        def read(r: int) -> None:
            try:
                while not done.is_set() or checked[r] == 0:
                    with lock:
                        keys = list(written[-4:])
                    for key in keys:
                        w, i = map(int, key.split("."))
                        assert_tree_equal(store.get(key), sample_payload(w * 1000 + i, frames=2), key)
                        checked[r] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
        threads += [threading.Thread(target=read, args=(r,)) for r in range(readers)]
        for t in threads:
            t.start()
        for t in threads[:writers]:
            t.join()
        done.set()
        for t in threads[writers:]:
            t.join()
        assert not errors, errors[0]
        assert store.size() == writers * per_writer
        assert all(n > 0 for n in checked)
        for key in written:
            w, i = map(int, key.split("."))
            assert_tree_equal(store.get(key), sample_payload(w * 1000 + i, frames=2), key)

    # -- lifecycle ---------------------------------------------------------------------------------

    def test_resume_keeps_data(self, tmp_path: Any) -> None:
        path = str(tmp_path / "store")
        store = self.make_store(path)
        if not type(store).persistent:
            store.close()
            pytest.skip(f"{type(store).__name__} is not persistent")
        store.put_many((f"k{i}", sample_payload(i)) for i in range(6))
        store.close()
        store = self.make_store(path, resume=True)
        try:
            assert sorted(store.keys()) == sorted(f"k{i}" for i in range(6))
            for i in range(6):
                assert_tree_equal(store.get(f"k{i}"), sample_payload(i))
        finally:
            store.close()

    def test_no_resume_starts_empty(self, tmp_path: Any) -> None:
        path = str(tmp_path / "store")
        store = self.make_store(path)
        store.put_many((f"k{i}", i) for i in range(4))
        store.close()
        store = self.make_store(path, resume=False)
        try:
            assert store.size() == 0 and store.keys() == []
            with pytest.raises(KeyError):
                store.get("k0")
        finally:
            store.close()
