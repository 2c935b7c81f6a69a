"""Several processes on one node open the same store: writers in children, a reader in the parent."""

from __future__ import annotations

import multiprocessing

import numpy as np

from mineonline_lmdb import LMDBStore


def _child_writes(path: str, worker: int) -> None:
    store = LMDBStore(path=path, num_shards=2, resume=True)  # resume: a second opener never clears
    store.put_many((f"{worker}.{i}", {"x": np.full(1000, worker * 100 + i, np.int32)}) for i in range(25))
    store.close()


def test_forked_children_write_while_the_parent_holds_the_store_open(tmp_path):
    path = str(tmp_path / "s")
    store = LMDBStore(path=path, num_shards=2, resume=False)
    try:
        store.put("parent", {"x": np.arange(3)})
        store.get("parent")  # the parent has live environments when it forks
        ctx = multiprocessing.get_context("fork")
        children = [ctx.Process(target=_child_writes, args=(path, w)) for w in range(3)]
        for child in children:
            child.start()
        for child in children:
            child.join(60)
        assert [child.exitcode for child in children] == [0, 0, 0]
        assert store.size() == 76
        for w in range(3):
            for i in (0, 24):
                assert int(store.get(f"{w}.{i}")["x"][-1]) == w * 100 + i
        store.put("parent-after", 1)  # the children's exits released nothing the parent relies on
        assert store.get("parent-after") == 1
    finally:
        store.close()
