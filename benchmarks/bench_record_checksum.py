"""What the record checksum (issue 36, item 4) costs per record, beside the ``lmdb`` store's own put and get.

The fragments are ``bench_lmdb``'s (1 MB and 20 MB: frames plus the small per-step columns). Per record it
times, alternating one by one so that a loaded machine slows all alike: the store's ``put`` and ``get``; the
old rule the rollout worker and the trainer ran (crc32 of key, rewards, log-probs: ``old_rule``); sealing at
write (``seal``: every column hashed, ``contracts.fragment.seal``) and verifying at read (``verify``: every
column hashed again and compared, plus the domain checks, ``contracts.fragment.verify_fragment``). Prints ONE
JSON line: milliseconds per record by CPU time of this thread (robust on a loaded machine; puts leave out
the fsync wait) and wall clock, and ``seal`` / ``put`` and ``verify`` / ``get`` ratios.

    PYTHONPATH=. python benchmarks/bench_record_checksum.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "plugins", "lmdb_buffer")]

from _benchlib import emit
from bench_lmdb import MB, fragment

from mineonline_core.contracts import fragment as F


def measure(root: str, size: int, count: int, rounds: int) -> dict[str, float]:
    from mineonline_lmdb import LMDBOptions, LMDBStore

    store = LMDBStore(path=os.path.join(root, f"store-{size}"), num_shards=1, options=LMDBOptions(map_size_mb=4096))
    payloads = []
    for i in range(count):
        payload = fragment(size, i)
        payload.update({F.STREAM: "0.0.0", F.INDEX: i})
        payloads.append(payload)
    keys = [F.fragment_key("0.0.0", i) for i in range(count)]
    wall = dict.fromkeys(("put", "old_rule_put", "seal", "get", "old_rule_get", "verify"), 0.0)
    cpu = dict.fromkeys(wall, 0.0)

    def timed(name, fn, *args, **kwargs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        wall[name] += time.perf_counter() - start
        cpu[name] += time.thread_time() - start_cpu
        return out

    try:
        for _ in range(rounds):
            crcs = []
            for key, payload in zip(keys, payloads):
                payload.pop(F.CHECKSUM, None)
                timed("old_rule_put", F.fragment_checksum, key, payload)  # unsealed: the old rule
                timed("seal", F.seal, payload)
                crcs.append(F.fragment_checksum(key, payload))
                timed("put", store.put, key, payload)
            for key, crc in zip(keys, crcs):
                got = timed("get", store.get, key)
                timed("old_rule_get", F._legacy_checksum, key, got)
                assert timed("verify", F.verify_fragment, key, got, checksum=crc, version=3) == []
    finally:
        store.close()
    n = count * rounds
    return {
        **{f"{name}_ms": 1e3 * t / n for name, t in cpu.items()},
        **{f"{name}_wall_ms": 1e3 * t / n for name, t in wall.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer fragments and rounds (CI smoke run)")
    args = parser.parse_args()
    rounds = 2 if args.quick else 3
    plan = {"1MB": (1 * MB, 16 if args.quick else 48), "20MB": (20 * MB, 2 if args.quick else 6)}
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for label, (size, count) in plan.items():
            ms = measure(root, size, count, rounds)
            ms["seal_over_put"] = ms["seal_ms"] / ms["put_ms"]
            ms["verify_over_get"] = ms["verify_ms"] / ms["get_ms"]
            ms["checksum_mb_per_s"] = size / MB / (ms["verify_ms"] / 1e3)
            results[label] = {k: round(v, 3) for k, v in ms.items()}
    emit(
        "record_checksum", {"unit": "ms per record (CPU time)", "rounds": rounds, "results": results}, quick=args.quick
    )


if __name__ == "__main__":
    main()
