"""One LMDB environment per shard directory, and the locking that map resizing needs.

LMDB forbids opening one environment twice in a process (closing either copy would drop the
process's POSIX locks), so ``Shard.acquire`` shares one ``Shard`` per directory per process,
reference-counted. ``set_mapsize`` requires that no transaction of this process is active on the
environment, hence the shared (every transaction) / exclusive (resize) guard. A forked child starts
with an empty table: LMDB environments must not be used across ``fork``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

from mineonline_core.errors import MineOnlineError
from mineonline_lmdb.verify import write_manifest

log = logging.getLogger("mineonline")
T = TypeVar("T")


class StoreFullError(MineOnlineError):
    """The disk under the store, or the store's map-size cap, has no room for more fragments."""


class StoreDamagedError(MineOnlineError):
    """A shard of a resumed store is truncated, emptied or garbled: what it held cannot be trusted."""


class Guard:
    """Shared (transactions) / exclusive (map resize) lock; a waiting resize gets priority.

    The shared side is on every read, so it is two plain method calls rather than a context manager.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive_waiting = 0
        self._exclusive = False

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._cond:
            self._shared -= 1
            if not self._shared and self._exclusive_waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class Shard:
    """One LMDB environment, shared by every store object of this process that opens its directory.

    LMDB forbids opening one environment twice in a process (its POSIX locks would be released by
    the first close), so environments are reference-counted per directory.
    """

    _open: ClassVar[dict[str, Shard]] = {}
    _open_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, directory: str, options: Any) -> None:
        self.lmdb = importlib.import_module("lmdb")
        self.directory = directory
        self.max_map = int(options.max_map_size_gb * 2**30)
        self.env = self.lmdb.open(
            directory,
            map_size=min(options.map_size_mb * 2**20, self.max_map),
            max_dbs=2,
            max_readers=options.max_readers,
            sync=options.sync,
            metasync=options.sync,
            readahead=False,
            lock=True,
        )
        self.meta = self.env.open_db(b"meta")
        self.parts = self.env.open_db(b"parts")
        self.guard = Guard()
        self.write_lock = threading.Lock()
        self.refs = 0

    @classmethod
    def acquire(cls, directory: str, options: Any) -> Shard:
        directory = os.path.realpath(directory)
        with cls._open_lock:
            shard = cls._open.get(directory)
            if shard is None:
                shard = cls._open[directory] = Shard(directory, options)
            shard.refs += 1
            return shard

    def release(self) -> None:
        with self._open_lock:
            self.refs -= 1
            if self.refs == 0:
                del self._open[self.directory]
                with self.guard.exclusive():
                    self.env.close()

    @classmethod
    def is_open(cls, directory: str) -> bool:
        return os.path.realpath(directory) in cls._open

    def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(txn, *args)`` in a read transaction whose values are views into the map."""
        while True:
            self.guard.acquire_shared()
            try:
                txn = self.env.begin(buffers=True)
                try:
                    return fn(txn, *args)
                finally:
                    txn.abort()  # a read transaction has nothing to commit
            except self.lmdb.MapResizedError:
                pass
            finally:
                self.guard.release_shared()
            self._adopt_new_size()

    def write(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(txn, *args)`` in one write transaction; grow the map and retry when it is full."""
        while True:
            grow = False
            self.guard.acquire_shared()
            try:
                with self.write_lock:
                    with self.env.begin(write=True) as txn:
                        result = fn(txn, *args)
                        stamp = txn.id(), txn.stat(self.meta)["entries"]
                    # After the commit, so that the manifest never vouches for more than the file holds.
                    write_manifest(self.directory, *stamp)
                    return result
            except self.lmdb.MapFullError:
                grow = True
            except self.lmdb.MapResizedError:
                pass
            finally:
                self.guard.release_shared()
            self._grow() if grow else self._adopt_new_size()

    def _adopt_new_size(self) -> None:
        with self.guard.exclusive():
            self.env.set_mapsize(0)  # 0: take the size another process has set

    def _grow(self) -> None:
        with self.guard.exclusive():
            self.env.set_mapsize(0)
            current = self.env.info()["map_size"]
            if current >= self.max_map:
                raise StoreFullError(
                    f"The LMDB shard {self.directory} has reached database_config.max_map_size_gb "
                    f"({self.max_map / 2**30:g} GiB) and cannot take more fragments. Raise "
                    "database_config.max_map_size_gb or num_shards, or lower replay_buffer_config.max_chunks."
                )
            new = min(current * 2, self.max_map)
            log.debug("growing LMDB map of %s from %d to %d MiB", self.directory, current >> 20, new >> 20)
            self.env.set_mapsize(new)

    def page_bytes(self) -> int:
        def count(txn: Any) -> int:
            total = 0
            for db in (self.meta, self.parts):
                st = txn.stat(db)
                total += (st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]) * st["psize"]
            return total

        return self.read(count)


def _forget_shards_after_fork() -> None:
    # The child drops its copies of the parent's environments (py-lmdb would otherwise refuse to
    # open them again here) and opens its own when it needs one. Closing a copy in the child leaves
    # the parent's locks and reader slots alone: both belong to the parent's pid.
    for shard in Shard._open.values():
        try:
            shard.env.close()
        except Exception:  # noqa: BLE001 - a copy that cannot close is merely leaked in the child
            pass
    Shard._open = {}
    Shard._open_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_shards_after_fork)
