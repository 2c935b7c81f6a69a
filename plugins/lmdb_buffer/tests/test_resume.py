"""A restart: resume keeps and serves what was stored; no resume starts empty, on purpose and logged."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from mineonline_core.errors import ConfigError
from mineonline_core.testing.store_conformance import assert_tree_equal, sample_payload
from mineonline_lmdb import LMDBStore


def test_fragments_before_a_restart_are_served_after_it(tmp_path):
    path = str(tmp_path / "replay")
    store = LMDBStore(path=path, num_shards=4, resume=False)
    store.put_many((f"0.0.{i}.000000000", sample_payload(i)) for i in range(20))
    store.delete_many([f"0.0.{i}.000000000" for i in range(5)])  # evicted before the restart
    before = store.nbytes()
    store.close()

    store = LMDBStore(path=path, num_shards=4, resume=True)
    try:
        assert sorted(store.keys()) == sorted(f"0.0.{i}.000000000" for i in range(5, 20))
        for i in range(5, 20):
            assert_tree_equal(store.get(f"0.0.{i}.000000000"), sample_payload(i))
        assert store.nbytes() == before
        store.put("new", {"x": np.arange(3)})  # the resumed store keeps accepting writes
        assert store.size() == 16
    finally:
        store.close()


def test_without_resume_the_store_is_emptied_and_it_is_logged(tmp_path, caplog):
    path = str(tmp_path / "replay")
    store = LMDBStore(path=path, num_shards=2, resume=False)
    store.put_many((f"k{i}", np.ones(1 << 16, np.uint8)) for i in range(40))
    store.close()
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("not ours")

    with caplog.at_level(logging.INFO, logger="mineonline"):
        store = LMDBStore(path=path, num_shards=2, resume=False)
    try:
        assert store.size() == 0
        assert store.disk_bytes() < 40 * (1 << 16)  # the old files were removed, not just emptied
        assert f"starting from an empty replay store at {path} (resume not set)" in caplog.text
        assert open(os.path.join(path, "notes.txt")).read() == "not ours"
    finally:
        store.close()


def test_resume_with_another_shard_count_is_refused(tmp_path):
    path = str(tmp_path / "replay")
    LMDBStore(path=path, num_shards=2, resume=False).close()
    with pytest.raises(ConfigError, match="num_shards=2"):
        LMDBStore(path=path, num_shards=3, resume=True)


def test_resume_of_a_missing_store_starts_empty(tmp_path):
    store = LMDBStore(path=str(tmp_path / "never-written"), num_shards=2, resume=True)
    try:
        assert store.size() == 0 and store.keys() == []
    finally:
        store.close()
