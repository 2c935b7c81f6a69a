"""A stored record that cannot be read costs its chunk, never the trainer's fetch (issue 36 items 3 and 4).

* an LMDB record damaged after the store was opened (here rewritten by another process) cannot be decoded:
  the store drops it with a warning, the fetch refuses its chunk (``trainer/corrupt_fragments``), counts it
  in ``buffer/corrupt_records`` and trains on another chunk (was: ``CorruptRecordError`` out of the fetch);
* the store host of an in-memory store is SIGKILLed: Ray restarts it, empty (its records died with it); the
  chunks that named them are refused as absent, and the run trains on what rollout stores next.

Real classes: the trainer's fetch, the replay buffer actor, the store host actor, the LMDB and memory stores.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from mineonline_lmdb import LMDBStore

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.store import MemoryStore
from tests.test_record_checksum import fragment, setup

pytest_plugins = ["mineonline_core.testing.fixtures"]
LMDB_TESTS = Path(__file__).resolve().parents[1] / "plugins" / "lmdb_buffer" / "tests"


def test_an_undecodable_lmdb_record_costs_its_chunk_not_the_fetch(local_ray, tmp_path, caplog) -> None:
    trainer, add, store = setup(local_ray, tmp_path, LMDBStore)
    bad_key = add(fragment("a", seed=1))
    good = fragment("b", seed=2)
    add(good)
    # Another process garbles the record's header while the store is open here and in its host.
    tamper = f"import test_tamper as t; t._tamper({str(tmp_path / 'replay')!r}, {bad_key!r}, header=bytes(range(256)))"
    subprocess.run([sys.executable, "-c", tamper], cwd=LMDB_TESTS, check=True)
    with caplog.at_level(logging.WARNING):
        batch = trainer.fetch_chunks(1)
    assert np.array_equal(batch[F.LOGPROB].numpy()[0], good[F.LOGPROB])  # trained on the other chunk only
    assert trainer.perf["buffer/corrupt_records"] == 1.0 and trainer.perf["trainer/corrupt_fragments"] == 1.0
    text = caplog.text
    assert f"record {bad_key!r}" in text and "dropped at a read" in text  # the store's warning
    assert f"refused fragment {bad_key}" in text and "cannot be read from the store" in text
    assert bad_key not in store.keys()  # dropped: no later read stops on it
    trainer.fetch_chunks(1)  # its chunk, served again, is absent now: refused, not counted again
    assert trainer.perf["buffer/corrupt_records"] == 1.0 and trainer.corrupt_fragments == 1


def test_a_restarted_in_memory_store_host_lost_its_records_and_the_fetch_goes_on(local_ray, tmp_path, caplog) -> None:
    ray = local_ray
    trainer, add, store = setup(local_ray, tmp_path, MemoryStore)
    lost = [add(fragment("a", seed=1)), add(fragment("b", seed=2))]
    pid = ray.get(store.host.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    assert store.keys() == []  # the call reaches the restarted host: an empty store, the records gone
    assert ray.get(store.host.__ray_call__.remote(lambda self: os.getpid())) != pid
    fresh = fragment("c", seed=3)
    add(fresh)  # rollout goes on storing into the restarted host
    with caplog.at_level(logging.WARNING, logger="mineonline_core.trainer.fetch"):
        batch = trainer.fetch_chunks(1)
    assert np.array_equal(batch[F.LOGPROB].numpy()[0], fresh[F.LOGPROB])
    assert trainer.corrupt_fragments == 2 and trainer.perf["buffer/corrupt_records"] == 0.0  # absent, not damaged
    assert all(f"refused fragment {key}" in caplog.text for key in lost) and "KeyError" in caplog.text


def test_a_restarted_lmdb_store_host_keeps_the_runs_records(local_ray, tmp_path) -> None:
    """The store host of an LMDB store is SIGKILLed: Ray restarts it, and it reopens the run's store as it is
    (a run started with ``resume=False`` must not have its records cleared by its own host's restart)."""
    ray = local_ray
    trainer, add, store = setup(local_ray, tmp_path, LMDBStore)
    kept = fragment("a", seed=1)
    key = add(kept)
    pid = ray.get(store.host.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    assert ray.get(store.host.__ray_call__.remote(lambda self: os.getpid())) != pid  # restarted, not dead
    # What the restarted host itself holds (this process's own reader would still see the files it opened).
    assert ray.get(store.host.keys.remote()) == [key]
    batch = trainer.fetch_chunks(1)
    assert np.array_equal(batch[F.LOGPROB].numpy()[0], kept[F.LOGPROB]) and trainer.corrupt_fragments == 0
