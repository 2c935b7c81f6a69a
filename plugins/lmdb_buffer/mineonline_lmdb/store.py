"""``LMDBStore``: fragment payloads in sharded LMDB environments on local disk.

Layout under ``database_config.path``::

    mineonline-store.json      format marker and shard count (a resume with another count is refused)
    shard-000/data.mdb, ...    one LMDB environment per shard; a key's shard is crc32(key) % num_shards

Each environment has two named databases: ``meta`` maps a key to its record header (with the small
arrays inline) and ``parts`` maps ``key NUL index`` to the raw buffer of one large array (see
``codec``). Storing each large array as its own LMDB value lets LMDB copy straight from the caller's
numpy buffer, so a put costs no extra copy of the bulk data.
A put (or a ``put_many`` on one shard) is one write transaction: whole or absent after a crash.
A store opened with ``resume`` is verified first (``verify``: each shard against its manifest and its
own page structure); a damaged shard refuses the open with ``StoreDamagedError``, naming the shard's
directory and the way out. Refusing, rather than continuing without the shard's records, is the
policy: the user decides, with one command, whether those records may go. Then every record of an
intact shard is checked (its header decodes, each part is there at its size): one that does not is
dropped with a warning naming it and counted in ``corrupt_records``; the run goes on with the others.
A record found undecodable at a read later (damaged after the open) is dropped the same way, and the
read raises ``CorruptRecordError`` naming it, so that the caller refuses what it belonged to.

Several processes on one node may open the same path (``multi_process``); LMDB's lock file
serialises their writers, and readers never block writers (MVCC). The map starts small and doubles
on ``MapFullError``; a process that sees ``MapResizedError`` adopts the new size and retries.
The environments and their locking live in ``shard``; the record format in ``codec``.
"""

from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import shutil
import zlib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from mineonline_core.errors import ConfigError, MineOnlineError
from mineonline_core.contracts.store import FragmentStore
from mineonline_lmdb import codec
from mineonline_lmdb.shard import Shard, StoreDamagedError, StoreFullError
from mineonline_lmdb.verify import verify_shards

log = logging.getLogger("mineonline")
# Dropped records named one by one in warnings; after these, every 100th.
_DROPS_NAMED = 20

LAYOUT_FILE = "mineonline-store.json"
FORMAT = "mineonline-lmdb/3"
_SEP = b"\x00"
# Errors from the OS that mean "the disk (or the allowed file size) is full". LMDB reports a short
# write at commit, which is what a filling disk produces, as EIO, so EIO is included.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
_DISK_FULL_TEXT = tuple(os.strerror(code) for code in _DISK_FULL)


class LMDBOptions(BaseModel):
    """The ``database_config`` keys the ``lmdb`` backend adds to ``backend``, ``path``, ``num_shards``."""

    model_config = ConfigDict(extra="forbid")

    map_size_mb: int = Field(64, ge=1, description="Initial LMDB map size per shard in MiB; it doubles when full.")
    max_map_size_gb: float = Field(
        1024.0, gt=0, description="Largest map size per shard in GiB; a shard that needs more is reported as full."
    )
    sync: bool = Field(True, description="fsync every commit, so committed fragments survive a power loss or kill -9.")
    max_readers: int = Field(1024, ge=8, description="Concurrent read transactions allowed per shard (all processes).")


def _part_key(key: bytes, index: int) -> bytes:
    return key + _SEP + index.to_bytes(4, "big")


def _write_records(txn: Any, shard: Shard, records: list[tuple[bytes, bytes, list]]) -> None:
    for key, header, parts in records:
        _delete_parts(txn, shard, key, start=len(parts))  # left over from a longer old value
        txn.put(key, header, db=shard.meta)
        for i, part in enumerate(parts):
            txn.put(_part_key(key, i), codec.raw_view(part), db=shard.parts)


def _delete_records(txn: Any, shard: Shard, keys: list[bytes]) -> None:
    for key in keys:
        if txn.delete(key, db=shard.meta):
            _delete_parts(txn, shard, key)


def _undecodable(txn: Any, shard: Shard) -> list[tuple[bytes, str]]:
    """The records of ``shard`` whose header does not parse or whose parts are missing or of the wrong size."""
    bad = []
    with txn.cursor(db=shard.meta) as cursor:
        for key, header in cursor.iternext(keys=True, values=True):
            key = bytes(key)
            try:
                plan = codec.parse_header(header).plan
                sizes = [None] * plan.part_count
                for index, _, nbytes in plan.part_copies:
                    sizes[index] = nbytes
                for index, nbytes in enumerate(sizes):
                    part = txn.get(_part_key(key, index), db=shard.parts)
                    if part is None:
                        raise codec.CorruptRecordError(f"part {index} is missing")
                    if nbytes is not None and len(part) != nbytes:
                        raise codec.CorruptRecordError(f"part {index} needs {nbytes} bytes, it holds {len(part)}")
            except codec.CorruptRecordError as exc:
                bad.append((key, str(exc)))
    return bad


def _delete_parts(txn: Any, shard: Shard, key: bytes, start: int = 0) -> None:
    """Delete the parts of ``key`` from index ``start`` on, by scanning the stored part keys rather
    than trusting a header's part count (a damaged header must not turn a delete into a long loop)."""
    prefix = key + _SEP
    with txn.cursor(db=shard.parts) as cursor:
        if not cursor.set_range(_part_key(key, start)):
            return
        while bytes(cursor.key()).startswith(prefix):
            if not cursor.delete():  # deletes and moves to the next entry; False at the end
                break


class LMDBStore(FragmentStore):
    """Fragment payloads in ``num_shards`` LMDB environments under ``database_config.path``."""

    name = "lmdb"
    Config = LMDBOptions
    multi_process = True
    persistent = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(self.options, LMDBOptions):
            self.options = LMDBOptions.model_validate(dict(self.options or {}))
        if self.num_shards < 1:
            raise ConfigError(
                f"database_config.num_shards is {self.num_shards}; the lmdb store needs at least 1 shard."
            )
        self.path = os.path.abspath(self.path)
        self._closed = False
        self._lmdb = importlib.import_module("lmdb")
        self.corrupt_records = 0  # records dropped because they could not be decoded (at open or at a read)
        with self._disk_errors():
            self._prepare_path()
            verified = self._verify()
            self._shards = [
                Shard.acquire(os.path.join(self.path, f"shard-{i:03d}"), self.options) for i in range(self.num_shards)
            ]
            if verified:
                self._drop_undecodable()
        if not self.resume:
            self.clear()  # a no-op after _prepare_path, except when this process already had it open

    # -- layout ------------------------------------------------------------------------------------

    def _prepare_path(self) -> None:
        layout_path = os.path.join(self.path, LAYOUT_FILE)
        layout = {"format": FORMAT, "num_shards": self.num_shards}
        if self.resume and os.path.exists(layout_path):
            try:
                with open(layout_path) as f:
                    found = json.load(f)
            except (OSError, ValueError) as exc:
                raise MineOnlineError(
                    f"database_config.path={self.path!r}: {LAYOUT_FILE} is unreadable ({exc}); the store "
                    "cannot be resumed. Remove the directory or start without resume."
                ) from None
            if found != layout:
                raise ConfigError(
                    f"database_config.path={self.path!r} holds a store written with {found}, but this run "
                    f"asks for {layout}. Resume with database_config.num_shards={found.get('num_shards')}, "
                    "or start without resume (the stored fragments are then discarded)."
                )
            return
        if not self.resume:
            log.info("starting from an empty replay store at %s (resume not set)", self.path)
            if os.path.isdir(self.path):
                for entry in os.listdir(self.path):
                    full = os.path.join(self.path, entry)
                    # Only what this store created is removed; other files under the path stay.
                    if entry.startswith("shard-") and os.path.isdir(full) and not Shard.is_open(full):
                        shutil.rmtree(full)
        os.makedirs(self.path, exist_ok=True)
        tmp = f"{layout_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(layout, f)
        os.replace(tmp, layout_path)

    def _verify(self) -> bool:
        """Refuse a resumed store whose shards are damaged, before this process maps any of them; True
        when it verified them (a resumed store this process had not opened yet)."""
        directories = [os.path.join(self.path, f"shard-{i:03d}") for i in range(self.num_shards)]
        if not self.resume or any(Shard.is_open(d) for d in directories):
            return False  # a new store, or one this process opened (and verified) already
        present = [d for d in directories if os.path.isdir(d)]
        if present and len(present) < len(directories):
            missing = sorted(set(directories) - set(present))
            log.warning(
                "replay store %s: %s missing; %s empty (the records it held, if any, are gone)",
                self.path,
                ", ".join(missing),
                "it starts" if len(missing) == 1 else "they start",
            )
        damaged = verify_shards(present)
        if damaged:
            shards = "; ".join(f"shard {d}: {problem}" for d, problem in damaged)
            remove = " ".join(repr(d) for d, _ in damaged)
            raise StoreDamagedError(
                f"The replay store under database_config.path={self.path!r} is damaged, so it cannot be resumed: "
                f"{shards}. To continue without the damaged shard's records, remove it (rm -r {remove}) and "
                f"resume again; to resume with an empty replay store, remove {self.path!r}. The checkpoints "
                "are not affected."
            )
        return True

    def _drop_undecodable(self) -> None:
        """Check every record's header and parts (their presence and sizes, not their bytes: the payload's
        own checksums are the reader's); drop those that cannot be decoded, each named in a warning."""
        for shard in self._shards:
            bad = shard.read(_undecodable, shard)
            if bad:
                self._write(shard, _delete_records, shard, [key for key, _ in bad])
                for key, why in bad:
                    self._dropped(shard, key, why, "at open")

    def _dropped(self, shard: Shard, key: bytes, why: str, when: str) -> None:
        self.corrupt_records += 1
        if self.corrupt_records <= _DROPS_NAMED or self.corrupt_records % 100 == 0:
            log.warning(
                "replay store %s: record %r in %s cannot be decoded (%s); dropped %s (%d so far, "
                "buffer/corrupt_records)",
                self.path,
                key.decode("utf-8", "replace"),
                shard.directory,
                why,
                when,
                self.corrupt_records,
            )

    def _group(self, keys: Iterable[bytes]) -> dict[int, list[tuple[int, bytes]]]:
        groups: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
        for position, key in enumerate(keys):
            groups[zlib.crc32(key) % self.num_shards].append((position, key))
        return groups

    @staticmethod
    def _key(key: str) -> bytes:
        if not isinstance(key, str):
            raise TypeError(f"store keys are str, got {type(key).__name__}")
        raw = key.encode("utf-8")
        if not raw or b"\x00" in raw or len(raw) > 400:
            raise ValueError(f"store key {key[:60]!r} must be 1..400 UTF-8 bytes without NUL")
        return raw

    @contextmanager
    def _disk_errors(self) -> Iterator[None]:
        """Turn a full disk into an error that names the config key to change."""
        try:
            yield
        except (self._lmdb.Error, OSError) as exc:
            self._raise_if_disk_full(exc)
            raise

    def _raise_if_disk_full(self, exc: BaseException) -> None:
        code = getattr(exc, "errno", None)
        text = str(exc)
        if isinstance(exc, self._lmdb.DiskError) or code in _DISK_FULL or any(t in text for t in _DISK_FULL_TEXT):
            raise StoreFullError(
                f"Writing to database_config.path={self.path!r} failed: the disk is full, a file-size "
                f"limit was hit, or the disk failed: "
                f"{type(exc).__name__}: {exc}. Free space there, point database_config.path at a larger "
                "disk, or lower replay_buffer_config.max_chunks."
            ) from exc

    def _write(self, shard: Shard, fn: Any, *args: Any) -> None:
        try:
            shard.write(fn, *args)
        except (self._lmdb.Error, OSError) as exc:
            self._raise_if_disk_full(exc)
            raise

    # -- FragmentStore -----------------------------------------------------------------------------

    def put(self, key: str, payload: Any) -> None:
        raw = self._key(key)
        shard = self._shards[zlib.crc32(raw) % self.num_shards]
        self._write(shard, _write_records, shard, [(raw, *codec.encode(payload))])

    def put_many(self, items: Iterable[tuple[str, Any]]) -> None:
        encoded = [(self._key(k), *codec.encode(p)) for k, p in items]
        for shard_index, members in self._group(k for k, _, _ in encoded).items():
            shard = self._shards[shard_index]
            self._write(shard, _write_records, shard, [encoded[position] for position, _ in members])

    def get(self, key: str) -> Any:
        raw = self._key(key)
        shard = self._shards[zlib.crc32(raw) % self.num_shards]
        return self._read(shard, self._read_one, shard, raw)

    def get_many(self, keys: Iterable[str]) -> list[Any]:
        raw_keys = [self._key(k) for k in keys]
        out: list[Any] = [None] * len(raw_keys)
        for shard_index, members in self._group(raw_keys).items():
            shard = self._shards[shard_index]
            self._read(shard, self._read_members, shard, members, out)
        return out

    def _read_members(self, txn: Any, shard: Shard, members: list[tuple[int, bytes]], out: list[Any]) -> None:
        for position, key in members:
            out[position] = self._read_one(txn, shard, key)

    def _read(self, shard: Shard, fn: Any, *args: Any) -> Any:
        """``shard.read``; a record found undecodable is dropped (after the read transaction) before its
        ``CorruptRecordError`` goes on to the caller."""
        try:
            return shard.read(fn, *args)
        except codec.CorruptRecordError as exc:
            key = getattr(exc, "key", None)
            if key is not None:
                self._write(shard, _delete_records, shard, [key])
                self._dropped(shard, key, str(exc.__cause__ or exc), "at a read")
            raise

    def _read_one(self, txn: Any, shard: Shard, key: bytes) -> Any:
        header = txn.get(key, db=shard.meta)
        if header is None:
            raise KeyError(key.decode("utf-8"))
        try:
            parsed = codec.parse_header(header)
            buffers = []
            for i in range(parsed.plan.part_count):
                buf = txn.get(_part_key(key, i), db=shard.parts)
                if buf is None:
                    raise codec.CorruptRecordError(f"part {i} is missing")
                buffers.append(buf)
            return codec.materialize(parsed, buffers)  # copies while the read transaction is live
        except codec.CorruptRecordError as exc:
            error = codec.CorruptRecordError(
                f"The record {key.decode('utf-8', 'replace')!r} in {shard.directory} is not a valid "
                f"mineonline record: {exc}. The store under database_config.path={self.path!r} is damaged or "
                "was written by another program; it is dropped from the store."
            )
            error.key, error.__cause__ = key, exc  # what _read drops, and why
            raise error from None

    def delete(self, key: str) -> None:
        self.delete_many([key])

    def delete_many(self, keys: Iterable[str]) -> None:
        for shard_index, members in self._group(self._key(k) for k in keys).items():
            shard = self._shards[shard_index]
            self._write(shard, _delete_records, shard, [key for _, key in members])

    def clear(self) -> None:
        for shard in self._shards:

            def drop(txn: Any, shard: Shard = shard) -> None:
                txn.drop(shard.meta, delete=False)
                txn.drop(shard.parts, delete=False)

            with self._disk_errors():
                shard.write(drop)

    def keys(self) -> list[str]:
        out: list[str] = []
        for shard in self._shards:

            def scan(txn: Any, shard: Shard = shard) -> None:
                with txn.cursor(db=shard.meta) as cursor:
                    out.extend(bytes(k).decode("utf-8") for k in cursor.iternext(keys=True, values=False))

            shard.read(scan)
        return out

    def size(self) -> int:
        return sum(shard.read(lambda txn, s=shard: txn.stat(s.meta)["entries"]) for shard in self._shards)

    def nbytes(self) -> int:
        """Bytes of the database pages holding live records (freed pages are reused, not counted)."""
        return sum(shard.page_bytes() for shard in self._shards)

    def disk_bytes(self) -> int:
        """Bytes the shards' data files occupy on disk (the high-water mark of ``nbytes``)."""
        return sum(os.path.getsize(os.path.join(s.directory, "data.mdb")) for s in self._shards)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for shard in self._shards:
                shard.release()
