"""Map growth from a tiny map, in one process and across processes; bounded disk; full disk."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

from mineonline_core.errors import MineOnlineError
from mineonline_lmdb import LMDBOptions, LMDBStore, StoreFullError

PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


def _block(seed: int, size: int = MB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([PLUGIN_ROOT, os.environ.get("PYTHONPATH", "")]))


def _map_sizes(store: LMDBStore) -> list[int]:
    return [shard.env.info()["map_size"] for shard in store._shards]


def test_map_grows_from_1mb_to_hold_50mb(tmp_path):
    store = LMDBStore(
        path=str(tmp_path / "s"), num_shards=2, resume=False, options=LMDBOptions(map_size_mb=1, sync=False)
    )
    try:
        assert _map_sizes(store) == [MB, MB]
        for i in range(40):
            store.put(f"k{i}", {"frames": _block(i)})
        store.put_many((f"big{i}", {"frames": _block(100 + i, 5 * MB)}) for i in range(2))  # one txn of 10 MB per shard
        assert store.size() == 42
        assert sum(_map_sizes(store)) >= 50 * MB
        for i in range(40):
            assert np.array_equal(store.get(f"k{i}")["frames"], _block(i))
        assert np.array_equal(store.get("big1")["frames"], _block(101, 5 * MB))
        assert store.nbytes() >= 50 * MB
    finally:
        store.close()


GROWER = r"""
import sys
import numpy as np
from mineonline_lmdb import LMDBOptions, LMDBStore
store = LMDBStore(path=sys.argv[1], num_shards=1, resume=True, options=LMDBOptions(map_size_mb=1))
for i in range(16):
    store.put(f"other{i}", np.full(1 << 20, i, np.uint8))
store.close()
"""


def test_another_process_grows_the_map_while_this_one_has_it_open(tmp_path):
    path = str(tmp_path / "s")
    store = LMDBStore(path=path, num_shards=1, resume=False, options=LMDBOptions(map_size_mb=1))
    try:
        store.put("mine", np.arange(10))
        subprocess.run([sys.executable, "-c", GROWER, path], check=True, env=_env(), timeout=120)
        # This process still maps 1 MiB; LMDB reports MapResizedError and the store adopts the new size.
        assert store.get("other15")[0] == 15 and store.size() == 17
        store.put("mine-after", np.full(2 * MB, 7, np.uint8))
        assert store.get("mine-after")[-1] == 7 and _map_sizes(store)[0] >= 16 * MB
    finally:
        store.close()


def test_deleted_fragments_free_space_for_new_ones(tmp_path):
    store = LMDBStore(path=str(tmp_path / "s"), num_shards=1, resume=False, options=LMDBOptions(sync=False))
    try:
        disk = []
        for round_ in range(6):  # a replay buffer evicting everything it wrote, six times over
            store.put_many((f"r{round_}.{i}", _block(i)) for i in range(20))
            disk.append(store.disk_bytes())
            store.delete_many([f"r{round_}.{i}" for i in range(20)])
        assert store.size() == 0 and store.nbytes() == 0
        # LMDB reuses a freed page once no transaction can still see it, i.e. from the next-but-one
        # write on: the file settles at about two rounds of data and then stops growing.
        assert disk[-1] <= 2.2 * disk[0] and disk[-1] <= 1.05 * disk[2], disk
    finally:
        store.close()


def test_overwrites_and_deletes_leave_no_orphan_parts(tmp_path):
    store = LMDBStore(path=str(tmp_path / "s"), num_shards=1, resume=False, options=LMDBOptions(sync=False))
    shard = store._shards[0]

    def entries() -> tuple[int, int]:
        return shard.read(lambda txn: (txn.stat(shard.meta)["entries"], txn.stat(shard.parts)["entries"]))

    try:
        big = 5000  # float64: 40 kB, above codec.INLINE_MAX, so each array is a part
        store.put("k", {f"a{i}": np.full(big, i) for i in range(6)})
        store.put("k2", [np.zeros(big)] * 3)
        assert entries() == (2, 9)
        store.put("k", (np.ones(big), None, np.ones(3)))  # shorter value: the five extra parts go
        assert entries() == (2, 4)
        store.delete_many(["k", "k2"])
        assert entries() == (0, 0) and store.nbytes() == 0
    finally:
        store.close()


def test_map_size_cap_is_a_clear_error(tmp_path):
    options = LMDBOptions(map_size_mb=1, max_map_size_gb=4 / 1024, sync=False)
    store = LMDBStore(path=str(tmp_path / "s"), num_shards=1, resume=False, options=options)
    try:
        with pytest.raises(StoreFullError, match="max_map_size_gb"):
            for i in range(8):
                store.put(f"k{i}", _block(i))
        store.put("small", 1)  # the failed transaction left the store usable
        assert store.get("small") == 1
    finally:
        store.close()


FILL = r"""
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
from mineonline_lmdb import LMDBStore
from mineonline_core.errors import MineOnlineError
store = LMDBStore(path=sys.argv[1], num_shards=1, resume=True)
try:
    for i in range(16):
        store.put(f"k{i}", np.ones(1 << 20, np.uint8))
except MineOnlineError as exc:
    print(type(exc).__name__, exc)
    store.put("small", 1)
    print("still usable", store.get("small"))
"""


def test_a_full_disk_names_the_config_key(tmp_path):
    path = str(tmp_path / "s")
    LMDBStore(path=path, num_shards=1, resume=False).close()
    # RLIMIT_FSIZE makes the data file unable to grow past 4 MiB, as a full disk would.
    result = subprocess.run([sys.executable, "-c", FILL, path], capture_output=True, text=True, env=_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("StoreFullError") and f"database_config.path={path!r}" in result.stdout
    assert "still usable 1" in result.stdout


def test_enospc_becomes_a_mineonline_error(tmp_path):
    store = LMDBStore(path=str(tmp_path / "s"), num_shards=1, resume=False)
    try:
        with pytest.raises(MineOnlineError, match="database_config.path"):
            with store._disk_errors():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    finally:
        store.close()
