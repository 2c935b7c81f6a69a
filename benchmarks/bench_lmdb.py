"""Put/get throughput of the ``lmdb`` fragment store against raw LMDB, for 1 MB and 20 MB fragments.

Both sides use one LMDB environment, the same ``sync`` setting and one write transaction per put.
Raw LMDB stores one pre-serialised ``bytes`` value per key; the store stores a fragment-like tree of
numpy arrays of the same total size and returns fresh arrays. Operations alternate one by one so
that disk and CPU noise hit both alike. Prints ONE JSON line: MB/s by wall clock (``put``, ``get``,
``raw_put``, ``raw_get``) and by CPU time of the calling thread (``*_cpu``: robust on a loaded
machine; for puts it leaves out the fsync wait), and the store/raw ratios of each.

    PYTHONPATH=. python benchmarks/bench_lmdb.py [--quick] [--no-sync] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "plugins", "lmdb_buffer")]

from _benchlib import emit  # noqa: E402

MB = 1 << 20


def fragment(nbytes: int, seed: int) -> dict:
    """A fragment of ``nbytes`` in total: mostly frames, plus the small per-step columns."""
    steps = 128
    rng = np.random.default_rng(seed)
    small = {
        "reward": rng.standard_normal(steps).astype(np.float32),
        "logprob": rng.standard_normal(steps).astype(np.float32),
        "vpred": rng.standard_normal(steps).astype(np.float32),
        "first": np.zeros(steps, bool),
        "version": np.full(steps, 3, np.int64),
        "state_in": [(rng.standard_normal((1, 64)).astype(np.float32), None)],
    }
    used = sum(a.nbytes for a in (small["reward"], small["logprob"], small["vpred"], small["first"], small["version"]))
    used += small["state_in"][0][0].nbytes
    frames = rng.integers(0, 256, nbytes - used, dtype=np.uint8)
    return {"obs": {"image": frames}, **small}


class Raw:
    """Raw LMDB: one pre-serialised bytes value per key, one write transaction per put."""

    def __init__(self, path: str, sync: bool) -> None:
        import lmdb

        self.env = lmdb.open(path, map_size=4 << 30, sync=sync, metasync=sync, readahead=False, max_readers=1024)

    def put(self, key: str, value: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key.encode(), value)

    def get(self, key: str) -> None:
        with self.env.begin() as txn:
            assert txn.get(key.encode()) is not None

    def close(self) -> None:
        self.env.close()


class Store:
    """The plugin's store, one shard so that it uses one environment like the raw side."""

    def __init__(self, path: str, sync: bool) -> None:
        from mineonline_lmdb import LMDBOptions, LMDBStore

        self.store = LMDBStore(path=path, num_shards=1, resume=False, options=LMDBOptions(map_size_mb=4096, sync=sync))

    def put(self, key: str, payload: dict) -> None:
        self.store.put(key, payload)

    def get(self, key: str) -> None:
        assert self.store.get(key)["obs"]["image"].size

    def close(self) -> None:
        self.store.close()


def measure(root: str, size: int, count: int, rounds: int, sync: bool) -> dict[str, float]:
    """Seconds per side and operation, summed over rounds: wall clock, and CPU time of this thread
    (``*_cpu``, which leaves out time spent preempted or waiting for fsync). Raw and store operations
    alternate one by one, so that the load of a shared machine slows both sides alike."""
    payloads = [fragment(size, i) for i in range(count)]
    values = [os.urandom(size) for _ in range(count)]
    keys = [f"f.{i:09d}" for i in range(count)]
    raw, store = Raw(os.path.join(root, f"raw-{size}"), sync), Store(os.path.join(root, f"store-{size}"), sync)
    seconds = {"raw_put": 0.0, "put": 0.0, "raw_get": 0.0, "get": 0.0}
    cpu = dict.fromkeys(seconds, 0.0)
    clock, cpu_clock = time.perf_counter, time.thread_time
    try:
        for _ in range(rounds):  # later rounds overwrite: steady state, freed pages reused
            for i, (key, value, payload) in enumerate(zip(keys, values, payloads)):
                pair = [("raw_put", raw.put, value), ("put", store.put, payload)]
                for name, op, arg in pair if i % 2 else pair[::-1]:  # who goes first alternates
                    start, start_cpu = clock(), cpu_clock()
                    op(key, arg)
                    seconds[name] += clock() - start
                    cpu[name] += cpu_clock() - start_cpu
            for i, key in enumerate(keys):
                pair = [("raw_get", raw.get), ("get", store.get)]
                for name, op in pair if i % 2 else pair[::-1]:
                    start, start_cpu = clock(), cpu_clock()
                    op(key)
                    seconds[name] += clock() - start
                    cpu[name] += cpu_clock() - start_cpu
    finally:
        raw.close()
        store.close()
    return {**seconds, **{f"{name}_cpu": t for name, t in cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer fragments and rounds (CI smoke run)")
    parser.add_argument("--no-sync", dest="sync", action="store_false", help="both sides without fsync per commit")
    parser.add_argument("--dir", default=None, help="directory for the databases (default: a temp dir)")
    args = parser.parse_args()

    rounds = 3 if args.quick else 5
    plan = {"1MB": (1 * MB, 24 if args.quick else 96), "20MB": (20 * MB, 3 if args.quick else 12)}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for label, (size, count) in plan.items():
            seconds = measure(root, size, count, rounds, args.sync)
            total_mb = size * count * rounds / MB
            mbps = {name: round(total_mb / t, 1) for name, t in seconds.items()}
            for op in ("put", "get"):
                mbps[f"{op}_ratio"] = round(mbps[op] / mbps[f"raw_{op}"], 3)
                mbps[f"{op}_cpu_ratio"] = round(mbps[f"{op}_cpu"] / mbps[f"raw_{op}_cpu"], 3)
            results[label] = mbps
    emit(
        "lmdb",
        {"unit": "MB/s", "sync": args.sync, "rounds": rounds, "target_ratio": 0.8, "results": results},
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
