"""One owner per run directory and per replay store (``mineonline_core.driver.rundir``).

The owner here is a real second process that takes the locks exactly as ``mineonline run`` does
(``rundir.claim_run``) and, for the store test, fills a real LMDB store. ``run`` in this process must then
refuse, before Ray starts and without touching the directory or the store, naming the owner.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mineonline_core.driver.api import run
from mineonline_core.driver.rundir import LOCK_NAME, RunInUseError, claim
from tests.conftest import cartpole_config

ROOT = Path(__file__).resolve().parents[1]
BASE = cartpole_config(
    run_name="owned",
    rollout_config={"replay_buffer_config": {"database_config": {"backend": "memory"}}},
    train_config={"num_iterations": 1},
)

# The owner: locks like `mineonline run` (rundir.claim_run), optionally fills an LMDB store, reports, then
# waits for a line on stdin; it answers with the store's size and exits.
OWNER = """
import json, sys
import numpy as np
from mineonline_core.driver.rundir import claim_run
from mineonline_core.config import load_config
from mineonline_core.registry import get_plugin_manager

cfg = load_config(json.loads(sys.argv[1])).config
ownership = claim_run(cfg, get_plugin_manager())
store = None
if cfg.rollout_config.replay_buffer_config.database_config.backend == "lmdb":
    from mineonline_lmdb import LMDBStore
    path = cfg.resolve_path(cfg.rollout_config.replay_buffer_config.database_config.path)
    store = LMDBStore(path=str(path), num_shards=2)
    store.put_many((f"frag-{i:03d}", {"obs": np.full((16, 4), i, np.float32)}) for i in range(60))
print("ready", flush=True)
sys.stdin.readline()
print("size", store.size() if store else 0, flush=True)
"""


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _refused(config: dict) -> RunInUseError:
    """``run(config)`` must refuse with ``RunInUseError`` and not start Ray on the way."""
    assert not _ray_running()
    with pytest.raises(RunInUseError) as info:
        run(config, progress=False)
    assert not _ray_running(), "a refused run started Ray"
    return info.value


def _owner(config: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, json.dumps(config)],
        cwd=ROOT,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()[-2000:] if proc.poll() is not None else line
    return proc


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate("go\n", timeout=60)
    return out


def test_a_second_run_on_a_live_run_directory_is_refused_naming_the_owner(tmp_path: Path) -> None:
    config = {**BASE, "output_dir": str(tmp_path)}
    owner = _owner(config)
    try:
        message = str(_refused(config))
    finally:
        _finish(owner)
    assert f"pid {owner.pid} on host {socket.gethostname()}" in message and "run 'owned'" in message
    assert "output_dir/run_name" in message and "Fix:" in message
    assert sorted(p.name for p in (tmp_path / "owned").iterdir()) == [LOCK_NAME]  # nothing written


def test_a_second_run_on_a_live_lmdb_store_is_refused_and_its_fragments_survive(tmp_path: Path) -> None:
    """A different run name, the same absolute ``database_config.path``: without the lock the second run's
    store opens the path without ``resume`` and clears the first run's 60 fragments."""
    store = tmp_path / "shared-store"
    db = {"backend": "lmdb", "path": str(store), "num_shards": 2}
    first = {
        **BASE,
        "run_name": "first",
        "output_dir": str(tmp_path),
        "rollout_config": {"replay_buffer_config": {"database_config": db}},
    }
    owner = _owner(first)
    try:
        message = str(_refused({**first, "run_name": "second"}))
    finally:
        answer = _finish(owner)
    assert "database_config.path" in message and str(store) in message and f"pid {owner.pid}" in message
    assert "run 'first'" in message
    assert "size 60" in answer  # the live store kept every fragment
    assert not (tmp_path / "second" / "run.json").exists()


def test_a_stale_lock_of_a_killed_owner_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {**BASE, "output_dir": str(tmp_path)}
    owner = _owner(config)
    os.kill(owner.pid, signal.SIGKILL)  # no release: the lock file still names it
    owner.wait(timeout=30)
    assert json.loads((tmp_path / "owned" / LOCK_NAME).read_text())["pid"] == owner.pid
    with caplog.at_level(logging.WARNING, logger="mineonline"):
        with claim(tmp_path / "owned", run_name="owned") as ownership:
            record = json.loads((tmp_path / "owned" / LOCK_NAME).read_text())
            assert record["pid"] == os.getpid() and record["host"] == socket.gethostname() and record["started"]
            assert ownership.locks
    assert any(f"pid {owner.pid}" in r.message and "no longer running" in r.message for r in caplog.records), (
        caplog.text
    )
    assert (tmp_path / "owned" / LOCK_NAME).read_text() == ""  # released: free, not stale
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mineonline"), claim(tmp_path / "owned", run_name="owned"):
        pass
    assert not caplog.records  # a released lock is taken silently


def test_the_same_process_cannot_take_a_held_lock_twice(tmp_path: Path) -> None:
    with claim(tmp_path / "run", run_name="a", store_path=tmp_path / "store"):
        with pytest.raises(RunInUseError, match=f"pid {os.getpid()}"):
            claim(tmp_path / "other", run_name="b", store_path=tmp_path / "store")
        assert (tmp_path / "other" / LOCK_NAME).read_text() == ""  # all or none: the first lock was let go
