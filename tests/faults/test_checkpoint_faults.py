"""Checkpoint faults (issue 28): writes interrupted by a kill, a checkpoint file swapped for a pickle
that runs code, the disk filling up under a run, SIGTERM while the trainer waits for data.

The first two need no Ray: what they guard happens on the driver before Ray starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from mineonline_core.errors import CheckpointError
from mineonline_core.testing.envs import PACED_CARTPOLE
from mineonline_core.testing.kit import mlp_policy
from mineonline_core.testing.procs import reap_session
from mineonline_core.trainer import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]


def _save(root: Path, iteration: int) -> Path:
    policy = mlp_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    return ckpt.save_checkpoint(
        root,
        iteration=iteration,
        model_state=policy.state_dict(),
        optimizer_state=opt.state_dict(),
        scaler_state={},
        trainer_state={"version": iteration, "learning_rate": 1e-3, "extra": {}},
        config_yaml="train_config:\n  save_interval: 1\n",
    )


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_temporary_checkpoints_of_dead_writers_are_removed_and_live_ones_spared(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    host = os.uname().nodename
    live = subprocess.Popen(["sleep", "600"])
    try:
        dead = _dead_pid()
        left = {  # what writers killed inside a write (and one still writing) leave behind
            "dead": tmp_path / f".checkpoint_000002.tmp-{dead}@{host}",
            "dead_replacing": tmp_path / f".checkpoint_000001.old-{dead}@{host}",
            "dead_old_name": tmp_path / f".checkpoint_000003.tmp-{dead}",
            "live": tmp_path / f".checkpoint_000004.tmp-{live.pid}@{host}",
            "other_host": tmp_path / f".checkpoint_000005.tmp-{dead}@another-host",
        }
        for path in left.values():
            path.mkdir()
            (path / "model.pt").write_bytes(b"partial")
        removed = ckpt.remove_stale_temporaries(tmp_path)
        assert sorted(removed) == sorted([left["dead"], left["dead_replacing"], left["dead_old_name"]])
        assert not left["dead"].exists() and not left["dead_replacing"].exists() and not left["dead_old_name"].exists()
        assert left["live"].is_dir() and (left["live"] / "model.pt").is_file()  # its writer may still be writing
        assert left["other_host"].is_dir()  # a pid of another host says nothing here
        assert [i for i, _ in ckpt.list_checkpoints(tmp_path)] == [1]
        ckpt.verify_checkpoint(tmp_path / "checkpoint_000001")
    finally:
        live.kill()
        live.wait()


def test_a_write_names_its_temporary_directory_after_its_process_and_host(tmp_path: Path, monkeypatch) -> None:
    seen = []
    real = ckpt._write_files
    monkeypatch.setattr(ckpt, "_write_files", lambda tmp, *a: (seen.append(tmp.name), real(tmp, *a)))
    _save(tmp_path, 3)
    assert seen == [f".checkpoint_000003.tmp-{os.getpid()}@{os.uname().nodename}"]
    assert ckpt.remove_stale_temporaries(tmp_path) == []  # nothing left behind by a whole write


class _Payload:
    """Unpickled by plain pickle (torch's loader without weights_only), it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _swap_for_payload(checkpoint: Path, name: str, marker: Path) -> None:
    """Replace ``name`` by a torch file whose pickle runs a command, and fix the manifest up to match."""
    torch.save({"state": _Payload(marker)}, checkpoint / name)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    data = (checkpoint / name).read_bytes()
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "trainer.pt"])
def test_a_checkpoint_file_that_runs_code_is_refused_before_ray_naming_it(tmp_path: Path, name: str, capsys) -> None:
    import ray

    from mineonline_core.cli import main

    run_dir = tmp_path / "runs" / "evil"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"run_name": "evil", "source_path": None, "overrides": []}))
    config = yaml.safe_load((ROOT / "examples" / "cartpole.yaml").read_text())
    (run_dir / "config.yaml").write_text(
        yaml.safe_dump({**config, "run_name": "evil", "output_dir": str(tmp_path / "runs")})
    )
    checkpoint = _save(run_dir / "checkpoints", 1)
    marker = tmp_path / "payload-ran"
    _swap_for_payload(checkpoint, name, marker)
    probe = tmp_path / "probe.pt"  # the payload is real: an unsafe load of the same bytes runs it
    probe.write_bytes((checkpoint / name).read_bytes())
    torch.load(probe, weights_only=False)  # unsafe on purpose: the payload is real
    assert marker.exists()
    marker.unlink()

    ckpt.verify_checkpoint(checkpoint)  # the manifest matches: only unpickling can tell
    code = main(["run", "--resume", str(run_dir), "--force", "--no-progress"])  # --force: past the config comparison
    err = capsys.readouterr().err
    assert code == 2
    assert not marker.exists()  # the payload never ran
    assert not ray.is_initialized()  # refused before Ray
    assert f"{str(checkpoint / name)!r} is refused" in err and "unsupported GLOBAL posix.system" in err
    assert "Traceback" not in err and "UnpicklingError" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(CheckpointError, match="is refused"):  # and the trainer's own load refuses it too
        ckpt.load_checkpoint(checkpoint)
    assert not marker.exists()


def _start_run(tmp_path: Path, data: dict, log_name: str = "driver.log") -> tuple[subprocess.Popen, Path]:
    """``mineonline run`` in a session of its own; returns the driver and its log file."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    log = tmp_path / log_name
    with open(log, "w") as handle:
        driver = subprocess.Popen(
            [sys.executable, "-m", "mineonline_core.cli", "run", str(config), "--no-progress"],
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return driver, log


def _end_session(driver: subprocess.Popen) -> list[int]:
    """Kill (by pid) what is left of the driver's session; return those pids."""
    if driver.poll() is None:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    return list(reap_session(driver.pid, grace_s=30))  # Ray's processes end on their own shortly after the driver


RUN = {
    "seed": 0,
    "env_config": {"name": "gymnasium", "id": PACED_CARTPOLE},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 16,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {"max_chunks": 16, "fragments_per_chunk": 1},
    },
    "train_config": {
        "num_workers": 1,
        "num_cpus_per_worker": 0.5,
        "num_iterations": 100_000,
        "batches_per_iteration": 1,
        "gradient_accumulation": 1,
        "batch_size_per_gpu": 2,
        "context_length": 16,
        "epochs_per_iteration": 1,
        "save_interval": 1000,
        "keep_interval": 1000,
    },
}


def test_sigterm_while_the_trainer_waits_for_data_stops_with_a_final_checkpoint(tmp_path: Path) -> None:
    """``fragment_length: 1000000``: no chunk for hours, the trainer waits in the buffer. SIGTERM must stop
    the run as it does mid-iteration: the wait released, a final checkpoint (of iteration 0: none ran),
    every actor ended, exit 0."""
    data = {**RUN, "run_name": "waiting", "output_dir": str(tmp_path / "runs")}
    data["rollout_config"] = {**RUN["rollout_config"], "fragment_length": 1_000_000}
    run_dir = tmp_path / "runs" / "waiting"
    driver, log = _start_run(tmp_path, data)
    try:
        end = time.monotonic() + 900  # a hang guard: beside two CPU burners the run took past 300 s to report
        # The rollout worker has sent its first report (env steps taken): the trainer is waiting by now.
        while "rollout/env_steps" not in (
            (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
        ):
            assert driver.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, "no rollout report within 900 s"
            time.sleep(0.5)  # polling the run's metrics file
        os.kill(driver.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = driver.wait(timeout=120)  # before the fix: still waiting 300 s later
        print(f"FIGURE SIGTERM while waiting for data: exited {code} after {time.monotonic() - signalled:.1f}s")
    finally:
        leftovers = _end_session(driver)
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert "run waiting interrupted" in output
    assert [i for i, _ in ckpt.list_checkpoints(run_dir / "checkpoints")] == [0]
    ckpt.load_checkpoint(run_dir / "checkpoints" / "checkpoint_000000")
    assert leftovers == []


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 40 MiB tmpfs: a real disk that fills up (skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip()}); the ENOSPC path is covered by "
            "tests/test_bad_input_storage.py::test_a_full_disk_while_checkpointing"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _keep_full(disk: Path, until: threading.Event) -> None:
    """Fill the disk down to its last byte, and again whenever something frees space (the run removing
    its partial checkpoint), as another writer on a shared disk would, until ``until`` is set."""
    with open(disk / "filler", "ab", buffering=0) as handle:
        while not until.is_set():
            for size in (1 << 20, 1 << 12, 1):
                try:
                    while True:
                        handle.write(b"\0" * size)
                except OSError:
                    continue
            until.wait(0.02)


def test_a_full_disk_under_the_run_is_one_message_last_on_the_console(small_disk: Path, tmp_path: Path) -> None:
    """The disk of the whole run directory fills up mid-run: the console ends with one message saying
    what was being written, where, and the free space; no traceback; the checkpoints written before
    it verify; closing run.log adds nothing."""
    data = {**RUN, "run_name": "full", "output_dir": str(small_disk / "runs")}
    data["train_config"] = {**RUN["train_config"], "save_interval": 1, "keep_interval": 1}
    # The in-memory store: the checkpoint is then what the full disk stops (the LMDB store's own message
    # for a full disk is its plugin's, plugins/lmdb_buffer/tests).
    rb = {**RUN["rollout_config"]["replay_buffer_config"], "database_config": {"backend": "memory"}}
    data["rollout_config"] = {**RUN["rollout_config"], "replay_buffer_config": rb}
    run_dir = small_disk / "runs" / "full"
    done = threading.Event()
    driver, log = _start_run(tmp_path, data)
    try:
        end = time.monotonic() + 300
        while not ckpt.list_checkpoints(run_dir / "checkpoints"):
            assert driver.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, "no checkpoint within 300 s"
            time.sleep(0.2)  # polling the file system for the first checkpoint
        filler = threading.Thread(target=_keep_full, args=(small_disk, done))
        filler.start()
        code = driver.wait(timeout=180)
    finally:
        done.set()
        leftovers = _end_session(driver)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    print(output[-3000:])
    assert code != 0 and "Traceback" not in output and "Logging error" not in output
    message, where = lines[-2:]  # the error and where its log is
    assert (
        message.startswith("error: train_config.save_path: writing checkpoint_")
        and str(run_dir / "checkpoints") in message
    )
    assert "No space left on device" in message and "MiB free of 40 MiB" in message
    assert where.startswith(f"(full log: {run_dir / 'run.log'}") and "OSError" not in where
    for _, path in ckpt.list_checkpoints(run_dir / "checkpoints"):
        ckpt.verify_checkpoint(path)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # no partial write left
    assert leftovers == []
