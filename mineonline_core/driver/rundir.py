"""One owner per run directory and per replay store: a lock file that names its owner.

``mineonline run`` (and ``--resume``) holds ``<run_dir>/.mineonline.lock`` and, for a persistent store,
``<database_config.path>/.mineonline.lock`` from before it writes anything until it ends. Two runs
in one directory would interleave their metrics and checkpoints; a second run opening a live store
without ``resume`` would clear the first run's fragments. A second run is refused instead, with a
message naming the owner (pid, host, start time, run).

The lock is ``flock`` on the open file, so the kernel drops it when the owner dies, however it dies
(``kill -9`` included). The file's text is only what a refused run shows: a file that names an
owner but is not locked was left by a dead owner and is taken over with a warning. Releasing
empties the file and unlocks it; the file itself is never deleted, because deleting a lock file
lets a waiting process lock the old inode while a third creates a new one.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mineonline_core.errors import ConfigError

log = logging.getLogger("mineonline")
LOCK_NAME = ".mineonline.lock"
RUN_FILE = "run.json"


class RunInUseError(ConfigError):
    """Another live process owns the run directory or the replay store."""


def _owner_text(record: dict) -> str:
    return (
        f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {record.get('started', '?')}"
        f" (run {record.get('run_name', '?')!r})"
    )


def _alive_here(record: dict) -> bool:
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OwnerLock:
    """An exclusive, advisory lock on ``directory`` held by this process until ``release``."""

    def __init__(self, directory: Path, *, key: str, run_name: str, purpose: str) -> None:
        self.directory, self.key, self.run_name, self.purpose = Path(directory), key, run_name, purpose
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; ``RunInUseError`` naming the owner when a live process holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            os.close(fd)
            raise RunInUseError(
                f"{self.key}: {str(self.directory)!r} is in use by another mineonline run: {_owner_text(record)}. "
                f"{self.purpose} Fix: wait for that run to end or stop it "
                f"(`mineonline stop {record.get('run_name', 'RUN')}`), or choose another run_name."
            ) from None
        stale = _read(fd)
        if stale:
            state = "is no longer running" if not _alive_here(stale) else "no longer holds it"
            log.warning(
                "%s: taking over the lock of %s left by %s, which %s",
                self.key,
                self.directory,
                _owner_text(stale),
                state,
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "run_name": self.run_name,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)  # an empty file is a free lock, not a stale one
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> dict:
    data = os.pread(fd, 4096, 0)
    if not data.strip():
        return {}
    try:
        record = json.loads(data)
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?", "run_name": f"unreadable lock file: {data[:60]!r}"}
    return record if isinstance(record, dict) else {}


class Ownership:
    """The locks of one run: its directory and, when the store persists on disk, the store's path."""

    def __init__(self, locks: list[OwnerLock]) -> None:
        self.locks = locks

    def release(self) -> None:
        for lock in reversed(self.locks):
            lock.release()

    def __enter__(self) -> Ownership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(run_dir: Path, *, run_name: str, store_path: Path | None = None) -> Ownership:
    """Lock ``run_dir`` and ``store_path`` (all or none); ``RunInUseError`` when another run holds one."""
    locks = [
        OwnerLock(
            run_dir,
            key="output_dir/run_name",
            run_name=run_name,
            purpose="Two runs in one directory would interleave their metrics and checkpoints.",
        )
    ]
    if store_path is not None and Path(store_path).resolve() != Path(run_dir).resolve():
        locks.append(
            OwnerLock(
                store_path,
                key="rollout_config.replay_buffer_config.database_config.path",
                run_name=run_name,
                purpose="Opening its replay store from a second run would clear or corrupt the first run's fragments; "
                "give this run its own database_config.path (a relative path lives in the run directory).",
            )
        )
    taken: list[OwnerLock] = []
    try:
        for lock in locks:
            lock.acquire()
            taken.append(lock)
    except BaseException:
        Ownership(taken).release()
        raise
    return Ownership(taken)


def claim_run(cfg: Any, pm: Any) -> Ownership:
    """Lock ``cfg``'s run directory and, when its store persists on disk, the store's path."""
    db = cfg.rollout_config.replay_buffer_config.database_config
    store_cls = pm.lookup("replay_store", db.backend)
    store_path = cfg.resolve_path(db.path) if getattr(store_cls, "persistent", False) else None
    return claim(cfg.run_dir(), run_name=str(cfg.run_name), store_path=store_path)


def refuse_existing_run(run_dir: Path, run_name: str) -> None:
    """A plain ``run`` never writes into a directory that holds an earlier run's metrics or checkpoints
    (a run that failed before either may be started again under its name)."""
    metrics = run_dir / "metrics.jsonl"
    if (metrics.exists() and metrics.stat().st_size > 0) or any(run_dir.glob("checkpoints/checkpoint_*")):
        raise ConfigError(
            f"run_name={run_name!r}: {str(run_dir)!r} already holds a run, and a second run there would append to "
            f"its metrics and overwrite its checkpoints. Fix: continue it with `mineonline run --resume {run_dir}`, "
            "give this run another name (run_name=...), or delete the directory."
        )


RECORDS = (RUN_FILE, "config.yaml", "source_config.txt")


def snapshot(run_dir: Path) -> dict[str, bytes | None]:
    """The run's records as they are, to put back if an attempt to continue it fails."""
    return {name: (run_dir / name).read_bytes() if (run_dir / name).is_file() else None for name in RECORDS}


def restore(run_dir: Path, saved: dict[str, bytes | None]) -> None:
    for name, data in saved.items():
        if data is None:
            (run_dir / name).unlink(missing_ok=True)
        else:
            (run_dir / name).write_bytes(data)


def record_cluster(run_dir: Path, address: str) -> None:
    """Note in ``run.json`` the address of the Ray cluster the run runs on, so that ``mineonline status``
    and ``stop`` given the run reach that cluster, never another one ``auto`` would pick."""
    path = run_dir / RUN_FILE
    record = json.loads(path.read_text())
    record["ray_address"] = address
    tmp = path.with_name(f".{RUN_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)
