"""kill -9 in the middle of writes: every key is whole or absent, every committed batch is there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

from mineonline_lmdb import LMDBStore

PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRITER = r"""
import sys, zlib
import numpy as np
from mineonline_lmdb import LMDBOptions, LMDBStore

def fragment(seed):
    image = np.random.default_rng(seed).integers(0, 256, (2, 256, 256, 3), dtype=np.uint8)
    return {"image": image, "seed": seed, "crc": zlib.crc32(image)}

# A 1 MiB initial map: the first run is killed while its maps keep doubling.
store = LMDBStore(path=sys.argv[1], num_shards=3, resume=True, options=LMDBOptions(map_size_mb=1))
first = int(sys.argv[2])
for batch in range(first, first + 10_000):
    store.put_many((f"b{batch:05d}.{j}", fragment(batch * 100 + j)) for j in range(8))
    print(f"committed {batch}", flush=True)
"""


def fragment(seed: int) -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (2, 256, 256, 3), dtype=np.uint8)
    return {"image": image, "seed": seed, "crc": zlib.crc32(image)}


def _run_and_kill(path: str, first: int, kill_after: int) -> int:
    """Start a writer, SIGKILL it right after it reports ``kill_after`` commits; the last batch committed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN_ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, str(first)], stdout=subprocess.PIPE, text=True, env=env
    )
    last = -1
    try:
        for line in proc.stdout:
            last = int(line.split()[1])
            if last >= first + kill_after - 1:
                os.kill(proc.pid, signal.SIGKILL)  # the writer is already inside its next put_many
                break
    finally:
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, f"writer ended with {proc.returncode} before it was killed"
    return last


def test_sigkill_mid_batch_leaves_every_key_whole_or_absent(tmp_path):
    path = str(tmp_path / "replay")
    LMDBStore(path=path, num_shards=3, resume=False).close()
    committed = [*range(0, _run_and_kill(path, 0, 6) + 1), *range(1000, _run_and_kill(path, 1000, 3) + 1)]

    store = LMDBStore(path=path, num_shards=3, resume=True)
    try:
        keys = store.keys()
        corrupt = 0
        for key in keys:
            batch, j = key[1:].split(".")
            got = store.get(key)
            want_seed = int(batch) * 100 + int(j)
            ok = got["seed"] == want_seed and got["crc"] == zlib.crc32(got["image"])
            ok = ok and np.array_equal(got["image"], fragment(want_seed)["image"])
            corrupt += not ok
        assert corrupt == 0
        present = set(keys)
        missing = [f"b{b:05d}.{j}" for b in committed for j in range(8) if f"b{b:05d}.{j}" not in present]
        assert missing == [], f"committed fragments lost: {missing[:5]}"
        # At most the one interrupted batch per run is partly there: nothing beyond what was attempted.
        attempted = {f"b{b:05d}" for b in committed} | {f"b{committed[5] + 1:05d}", f"b{committed[-1] + 1:05d}"}
        assert {k.split(".")[0] for k in keys} <= attempted
        store.put("after-crash", fragment(1))
        assert store.get("after-crash")["seed"] == 1
    finally:
        store.close()


def _writer_in_txn(path: str, first: int, commits: int, conn) -> None:
    """Commit ``commits`` batches, then put half of the next batch's records into an open write
    transaction, tell the parent, and wait there for the SIGKILL. Runs in a forked child: a fresh
    interpreter would spend seconds importing what this process has already."""
    from mineonline_lmdb import store as store_module

    original = store_module._write_records

    def write_then_hang(txn, shard, records):
        original(txn, shard, records[: len(records) // 2 + 1])
        conn.send(("in-txn", first + commits))
        time.sleep(600)

    store = LMDBStore(path=path, num_shards=1, resume=True)
    for batch in range(first, first + commits):
        store.put_many((f"b{batch:05d}.{j}", small_fragment(batch * 100 + j)) for j in range(6))
        conn.send(("committed", batch))
    store_module._write_records = write_then_hang
    batch = first + commits
    store.put_many((f"b{batch:05d}.{j}", small_fragment(batch * 100 + j)) for j in range(6))


def small_fragment(seed: int) -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    return {"image": image, "seed": seed, "crc": zlib.crc32(image)}


def test_writer_killed_inside_the_write_transaction_20_times(tmp_path):
    """SIGKILL while a write transaction is open (records put, not committed), 20 times: every read
    afterwards is whole, every committed batch is there and no record of an interrupted batch is."""
    import multiprocessing

    path = str(tmp_path / "replay")
    ctx = multiprocessing.get_context("fork")
    committed: list[int] = []
    interrupted: list[int] = []
    for run in range(20):
        first, commits = run * 10, run % 3  # 0, 1 or 2 batches commit before the killed one
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_writer_in_txn, args=(path, first, commits, child), daemon=True)
        proc.start()
        try:
            while True:
                assert parent.poll(60), f"writer {run} went silent"
                what, batch = parent.recv()
                if what == "committed":
                    committed.append(batch)
                    continue
                os.kill(proc.pid, signal.SIGKILL)  # the writer is inside the transaction, waiting
                interrupted.append(batch)
                break
        finally:
            proc.join(timeout=60)
            parent.close()
        assert proc.exitcode == -signal.SIGKILL, f"writer {run} ended with {proc.exitcode} before it was killed"

        store = LMDBStore(path=path, num_shards=1, resume=True)
        try:
            keys = store.keys()
            corrupt = 0
            for key, got in zip(keys, store.get_many(keys)):
                batch, j = key[1:].split(".")
                want = int(batch) * 100 + int(j)
                corrupt += not (got["seed"] == want and got["crc"] == zlib.crc32(got["image"]))
        finally:
            store.close()
        assert corrupt == 0
        assert {int(k[1:6]) for k in keys} == set(committed)  # all committed batches, nothing interrupted
        assert len(keys) == 6 * len(committed)
    assert len(interrupted) == 20
    print(
        f"FIGURE LMDB writer SIGKILLed inside the write transaction 20 times: 0 corrupt reads of "
        f"{6 * len(committed)} records, {len(committed)} committed batches all present, "
        f"0 records of 20 interrupted batches"
    )
