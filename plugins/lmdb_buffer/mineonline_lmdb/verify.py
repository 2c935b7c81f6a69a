"""Verification of a resumed store's shards, and the per-shard manifest it checks them against.

LMDB keeps no checksums, and a damaged data file does not fail cleanly: a file truncated to 0 bytes
is re-created empty (the records silently gone), one shorter than its pages kills the process that
maps it with SIGBUS, and a garbled page surfaces later as ``MDB_CORRUPTED`` in whichever actor reads
it. So a store opened with ``resume`` checks every shard before any process of the run maps it:

* the **manifest** ``shard-NNN/mineonline-shard.json`` holds ``{"txnid": T, "records": N}``: the
  shard held N records after its transaction T. Every write rewrites it after its commit (write,
  then ``os.replace``), so it is always a committed state and never ahead of the data file: an intact
  shard is at transaction T or later, with exactly N records when at T. A data file that is missing,
  empty, or at an older transaction lost what the manifest vouches for. Several writers race to
  rewrite it; whichever lands last is still a committed state, so the check stays sound;
* the data file must be as long as the last page its meta page names (a shorter one was truncated);
* every branch and leaf page of both databases is walked, and the records counted against the
  database's own count and the manifest.

The checks run in a child interpreter (``python -I`` on this file, importing only ``lmdb``): a page
that makes LMDB fault kills the child, which is then itself the verdict, never the store's process.
A shard that fails is reported with its directory and what was found; ``LMDBStore`` refuses to open
(see ``StoreDamagedError``). Record payloads (tampered headers, parts) are validated when read, by
``codec``; this walk checks the structure that every read depends on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

MANIFEST = "mineonline-shard.json"
DATA = "data.mdb"
_META_PAGES = 2  # LMDB's two meta pages start every data file


def read_manifest(directory: str) -> dict[str, int] | None:
    """The shard's manifest, or None when there is none (a shard never written to)."""
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            found = json.load(f)
        return {"txnid": int(found["txnid"]), "records": int(found["records"])}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its manifest {MANIFEST} is unreadable ({type(exc).__name__}: {exc})") from None


def write_manifest(directory: str, txnid: int, records: int) -> None:
    """Record that the shard held ``records`` records after its committed transaction ``txnid``."""
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"txnid": txnid, "records": records}))
    os.replace(tmp, path)


def check_shard(directory: str) -> str | None:
    """What is wrong with the shard in ``directory``, or None. May crash (SIGBUS) on a damaged page:
    run it through ``verify_shards``."""
    import lmdb

    try:
        manifest = read_manifest(directory)
    except ValueError:
        manifest = None  # torn by a power loss (it is not fsynced): the structure is still checked
    data = os.path.join(directory, DATA)
    vouched = manifest is not None and manifest["records"] > 0  # an empty file then lost nothing
    said = (
        ""
        if manifest is None
        else f"; its manifest says {manifest['records']} records at transaction {manifest['txnid']}"
    )
    if not os.path.exists(data):
        return f"{DATA} is missing{said}" if vouched else None
    size = os.path.getsize(data)
    if size == 0:
        return f"{DATA} is empty (0 bytes){said}" if vouched else None
    try:
        # lock=True: registered as a reader, so that a live writer never reuses the pages being walked.
        env = lmdb.open(directory, readonly=True, lock=True, max_dbs=2, readahead=False)
    except lmdb.Error as exc:
        return f"{DATA} ({size} bytes) is not a readable LMDB file ({type(exc).__name__}: {exc}){said}"
    try:
        info, psize = env.info(), env.stat()["psize"]
        needed = (info["last_pgno"] + 1) * psize
        if size < max(needed, _META_PAGES * psize):
            return f"{DATA} is {size} bytes but its pages reach {needed} bytes: the file was truncated{said}"
        with env.begin(buffers=True) as txn:
            txnid = txn.id()
            if vouched and txnid < manifest["txnid"]:
                return (
                    f"{DATA} is at transaction {txnid}, older than the {manifest['txnid']} it had committed "
                    f"(the file was replaced or rolled back){said}"
                )
            counts = {}
            for name in (b"meta", b"parts"):
                db = env.open_db(name, txn=txn, create=False)
                walked = sum(1 for _ in txn.cursor(db=db).iternext(keys=True, values=True))
                stated = txn.stat(db)["entries"]
                if walked != stated:
                    return f"its {name.decode()} database has {walked} records where its header says {stated}{said}"
                counts[name] = walked
            if manifest is not None and txnid == manifest["txnid"] and counts[b"meta"] != manifest["records"]:
                return f"it holds {counts[b'meta']} records at transaction {txnid}{said}"
    except lmdb.Error as exc:
        return f"reading its pages failed: {type(exc).__name__}: {exc}{said}"
    finally:
        env.close()
    return None


def verify_shards(directories: list[str]) -> list[tuple[str, str]]:
    """``(directory, problem)`` for each damaged shard among ``directories``, checked in a child
    interpreter; a shard that crashes the child is damaged (the crash is the finding)."""
    if not directories:
        return []
    proc = subprocess.run(
        [sys.executable, "-I", os.path.abspath(__file__), *directories], capture_output=True, text=True, check=False
    )
    found: list[tuple[str, str]] = []
    current: str | None = None
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        event: dict[str, Any] = json.loads(line)
        if "checking" in event:
            current = event["checking"]
        elif "problem" in event:
            found.append((event["shard"], event["problem"]))
            current = None
        else:
            current = None
    if proc.returncode > 0:  # the checker itself failed (not the shard): an error of this program
        raise RuntimeError(
            f"the LMDB store checker failed (exit status {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    if proc.returncode < 0:
        found.append(
            (
                current or directories[0],
                f"reading its pages killed the store checker with "
                f"{signal.Signals(-proc.returncode).name}: a page lies beyond the end of the file or is garbled",
            )
        )
    return found


def _main(directories: list[str]) -> None:
    for directory in directories:
        print(json.dumps({"checking": directory}), flush=True)
        problem = check_shard(directory)
        print(json.dumps({"shard": directory, "problem": problem} if problem else {"ok": directory}), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
