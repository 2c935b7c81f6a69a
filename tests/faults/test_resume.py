"""Kill the driver (and with it the trainer) mid-run with SIGKILL, then ``mineonline run --resume``.

The first run is the real CLI in its own session; it is killed once it has written checkpoint 2 (the
driver-kill test: with an iteration published past its latest checkpoint, fragments of that version kept
in the LMDB store).
The resumed run (``api.run(resume=RUN_DIR)``, what ``--resume`` calls) must continue at the next
iteration after its latest checkpoint, with a continuous version sequence, losing at most
``save_interval`` iterations of work, and must finish the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mineonline_core.testing.envs import PACED_CARTPOLE
from mineonline_core.testing.faults import live_records
from mineonline_core.testing.procs import descendants, reap_session
from mineonline_core.trainer.checkpoint import list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS, SAVE_INTERVAL, MORE = 100_000, 1, 2  # the first run is killed or stopped long before the end

CONFIG = {
    "run_name": "kill-resume",
    "seed": 0,
    "env_config": {"name": "gymnasium", "id": PACED_CARTPOLE},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 16,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {"max_chunks": 64, "fragments_per_chunk": 1},
    },
    "train_config": {
        "num_workers": 1,
        "num_cpus_per_worker": 0.5,
        "num_iterations": ITERATIONS,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "batch_size_per_gpu": 2,
        "context_length": 16,
        "epochs_per_iteration": 1,
        "save_interval": SAVE_INTERVAL,
        "keep_interval": 1,
    },
}


def _iterations_logged(run_dir: Path, after: float = 0.0) -> list[int]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "trainer/iteration" in record and record.get("time", 0.0) > after:
            out.append(int(record["trainer/iteration"]))
    return out


def _start_run(tmp_path: Path, data: dict, log_name: str) -> tuple[subprocess.Popen, Any]:
    """``mineonline run`` of ``data`` in a session of its own (so the test can signal it and count what it
    leaves behind); returns the driver and its open log file, which the caller closes."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    log = open(tmp_path / log_name, "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "mineonline_core.cli", "run", str(config), "--no-progress"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return driver, log


def _rollout_holds(run_dir: Path, version: int) -> bool:
    """Whether a rollout record shows the workers at ``version`` and a later one shows more fragments sent
    (so the store holds fragments written with that version's weights)."""
    sent_at = None
    for record in live_records(run_dir):
        if "rollout/fragments_sent" not in record:
            continue
        if sent_at is None and record.get("rollout/model_version", -1) >= version:
            sent_at = record["rollout/fragments_sent"]
        elif sent_at is not None and record["rollout/fragments_sent"] > sent_at:
            return True
    return False


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (a SIGSTOP takes effect on each thread as it is next
    scheduled: a checkpoint's last write may land after ``kill`` returned)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # a thread that ended meanwhile
    return bool(states) and all(state in "Tt" for state in states)


def _newest_stored_version(store_dir: Path) -> int:
    from mineonline_lmdb.store import LMDBStore

    store = LMDBStore(path=str(store_dir), num_shards=8, resume=True)  # the default database_config.num_shards
    try:
        return max(int(payload["version"].max()) for payload in store.get_many(store.keys()))
    finally:
        store.close()


def test_driver_killed_then_resumed(tmp_path: Path) -> None:
    """The driver is killed with an iteration published past its latest checkpoint and fragments of that
    version in the kept LMDB store: the resume numbers its versions past every stored one, so those fragments
    train at a non-negative staleness and none is refused as corrupt (was: refused by the domain check)."""
    run_dir = tmp_path / "runs" / "kill-resume"
    data = {**CONFIG, "output_dir": str(tmp_path / "runs")}
    data["train_config"] = {**CONFIG["train_config"], "save_interval": 2, "keep_interval": 2}
    driver, log = _start_run(tmp_path, data, "first.log")

    def wait_for(predicate, what: str, timeout: float = 480.0) -> None:
        end = time.monotonic() + timeout
        while not predicate():
            assert driver.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < end, f"{what} not within {timeout:.0f} s"
            time.sleep(0.5)  # polling the run's files

    def frozen_past_checkpoint() -> bool:  # judged while the driver (the trainer) cannot write a checkpoint
        os.kill(driver.pid, signal.SIGSTOP)
        wait_for(lambda: _all_threads_stopped(driver.pid), "the driver's threads stopped", timeout=60)
        saved = max((i for i, _ in list_checkpoints(run_dir / "checkpoints")), default=0)
        if saved >= 2 and max(_iterations_logged(run_dir), default=0) > saved:
            return True
        os.kill(driver.pid, signal.SIGCONT)
        return False

    try:
        wait_for(frozen_past_checkpoint, "an iteration logged past checkpoint 2 or later")
        published = int([r for r in live_records(run_dir) if "trainer/version" in r][-1]["trainer/version"])
        # The driver stays frozen: rollout goes on with the weights published past the checkpoint.
        wait_for(lambda: _rollout_holds(run_dir, published), f"fragments of version {published} stored")
        os.kill(driver.pid, signal.SIGKILL)
        killed_at = time.time()
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
        log.close()
    # Ray ends the killed driver's local cluster by itself: its raylet and GCS share the driver's fate at
    # once, but its per-node agents first try to report the raylet's death to the dead GCS, which takes
    # up to a minute of RPC timeouts on a loaded machine. Then clean up what we started, by pid.
    leftovers = reap_session(driver.pid, grace_s=120)  # only processes of the session this test created
    gone_s = time.time() - killed_at
    assert not leftovers, (
        f"{len(leftovers)} processes of the killed driver's session outlived it by 120 s: {sorted(leftovers.values())}"
    )

    checkpoint_iteration, checkpoint_path = list_checkpoints(run_dir / "checkpoints")[-1]
    checkpoint_version = int(torch.load(checkpoint_path / "trainer.pt", weights_only=True)["version"])
    reached = max(_iterations_logged(run_dir), default=0)
    lost = reached - checkpoint_iteration
    assert 1 <= lost <= 2, (list_checkpoints(run_dir / "checkpoints"), _iterations_logged(run_dir))
    stored = _newest_stored_version(run_dir / "replay_buffer")
    assert stored > checkpoint_version  # the case: fragments newer than the checkpoint kept in the store

    from mineonline_core.driver.api import run

    started, started_wall = time.monotonic(), time.time()  # the killed run's logging actor is gone by now
    final = checkpoint_iteration + MORE  # the resumed run trains MORE iterations, then ends
    result = run(None, [f"train_config.num_iterations={final}"], resume=str(run_dir), progress=False)
    resume_s = time.monotonic() - started
    assert result["status"] == "completed", result
    assert result["iteration"] == final
    resumed = _iterations_logged(run_dir, after=started_wall)
    assert resumed and resumed[0] == checkpoint_iteration + 1  # continues at the next iteration
    assert sorted(set(resumed)) == list(range(checkpoint_iteration + 1, final + 1))

    after = [r for r in live_records(run_dir) if "trainer/iteration" in r and r.get("time", 0.0) > started_wall]
    assert [r.get("trainer/corrupt_fragments") for r in after] == [0.0] * len(after)  # nothing refused
    assert min(r["trainer/staleness_mean"] for r in after) >= 0.0
    before = [r for r in live_records(run_dir) if "trainer/iteration" in r and r.get("time", 0.0) <= started_wall]
    step = int(before[1]["trainer/version"]) - int(before[0]["trainer/version"])
    versions = [int(r["trainer/version"]) for r in after]
    # Versions go on past every stored fragment's, one step per iteration: no worker sees a version twice.
    assert versions[0] > stored and versions == list(range(versions[0], versions[0] + step * len(after), step))
    assert result["version"] == versions[-1]
    print(
        f"FIGURE driver SIGKILL at iteration {reached} (checkpoint {checkpoint_iteration}, version "
        f"{checkpoint_version}, stored fragments up to version {stored}): {lost} iteration(s) lost, resumed at "
        f"{checkpoint_iteration + 1} with version {versions[0]}, 0 corrupt fragments, finished {final} in "
        f"{resume_s:.0f}s; the killed driver's session had 0 processes left {gone_s:.1f}s after the kill"
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_stops_within_seconds_with_a_final_checkpoint(tmp_path: Path, signum: int) -> None:
    """SIGINT (Ctrl-C) or SIGTERM (a preemption) on ``mineonline run``: the trainer finishes its
    iteration, writes a final checkpoint (save_interval is far away), the driver ends every actor and exits 0."""
    data = {**CONFIG, "run_name": "ctrl-c", "output_dir": str(tmp_path / "runs")}
    data["train_config"] = {**CONFIG["train_config"], "save_interval": 1000, "keep_interval": 1000}
    run_dir = tmp_path / "runs" / "ctrl-c"
    driver, log = _start_run(tmp_path, data, "driver.log")
    try:
        end = time.monotonic() + 480
        while not (run_dir / "metrics.jsonl").exists() or max(_iterations_logged(run_dir), default=0) < 2:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < end, "no iteration 2 within 480 s"
            time.sleep(0.5)  # polling the run's metrics file
        assert list_checkpoints(run_dir / "checkpoints") == []  # nothing saved yet: the stop must save
        os.kill(driver.pid, signum)
        interrupted_at = time.monotonic()
        code = driver.wait(timeout=120)
        exit_s = time.monotonic() - interrupted_at
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
        log.close()
    output = (tmp_path / "driver.log").read_text()
    assert code == 130, output[-3000:]  # stopped, not finished: a script can tell
    assert "run ctrl-c interrupted" in output
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    assert len(checkpoints) == 1 and checkpoints[0][0] >= 2
    assert checkpoints[0][0] == max(_iterations_logged(run_dir))  # the iteration it had reached
    assert reap_session(driver.pid, grace_s=30) == {}
    print(
        f"FIGURE {signal.Signals(signum).name}: exited 130 after {exit_s:.1f}s, "
        f"final checkpoint at iteration {checkpoints[0][0]}, 0 processes left"
    )


def test_dead_trainer_rank_is_restarted_from_the_latest_checkpoint(tmp_path: Path) -> None:
    """SIGKILL the Ray Train rank mid-run: training restarts from the run's latest checkpoint and
    continues at the iteration after it (trainer/restarts 1); the run then stops cleanly on Ctrl-C."""
    data = {**CONFIG, "run_name": "kill-rank", "output_dir": str(tmp_path / "runs")}
    # Ray Train ranks: a single rank otherwise trains inside the driver, where it cannot die alone.
    # Every second iteration checkpointed: the rank is killed with an iteration logged past the latest one.
    data["train_config"] = {
        **CONFIG["train_config"],
        "max_trainer_restarts": 1,
        "use_ray_train": True,
        "save_interval": 2,
        "keep_interval": 2,
    }
    run_dir = tmp_path / "runs" / "kill-rank"
    driver, log = _start_run(tmp_path, data, "driver.log")

    def wait_for(predicate, what: str, timeout: float = 300.0) -> float:
        end = time.monotonic() + timeout
        while not predicate():
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.monotonic() < end, f"{what} not within {timeout:.0f} s"
            time.sleep(0.5)  # polling the run's files
        return time.monotonic()

    def restarted_iterations() -> list[int]:
        return [int(r["trainer/iteration"]) for r in live_records(run_dir) if r.get("trainer/restarts") == 1]

    try:
        wait_for(lambda: any(i >= 2 for i, _ in list_checkpoints(run_dir / "checkpoints")), "checkpoint 2")

        def past_checkpoint() -> bool:  # an iteration logged that the next attempt will train again
            logged = [int(r["trainer/iteration"]) for r in live_records(run_dir) if "trainer/iteration" in r]
            return max(logged) > max(i for i, _ in list_checkpoints(run_dir / "checkpoints"))

        (rank,) = [pid for pid, cmd in descendants(driver.pid).items() if "RayTrainWorker" in cmd]

        def frozen_past_checkpoint() -> bool:  # judged while the rank cannot write a checkpoint
            os.kill(rank, signal.SIGSTOP)
            if past_checkpoint():
                return True
            os.kill(rank, signal.SIGCONT)
            return False

        wait_for(frozen_past_checkpoint, "an iteration past the latest checkpoint")
        os.kill(rank, signal.SIGKILL)
        killed_at = time.monotonic()
        recovered_s = wait_for(lambda: restarted_iterations(), "an iteration after the restart") - killed_at
        wait_for(lambda: len(restarted_iterations()) >= 3, "three iterations after the restart")
        os.kill(driver.pid, signal.SIGINT)
        code = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
        log.close()
    output = (tmp_path / "driver.log").read_text()
    assert code == 130 and "run kill-rank interrupted" in output, output[-3000:]
    assert "a train worker died" in output and "restart 1 of 1" in output
    iterations = [r for r in live_records(run_dir) if "trainer/iteration" in r]
    after = [int(r["trainer/iteration"]) for r in iterations if r.get("trainer/restarts") == 1]
    before = [int(r["trainer/iteration"]) for r in iterations if r.get("trainer/restarts") == 0]
    resumed_from = after[0] - 1
    assert after == list(range(after[0], after[0] + len(after)))  # no iteration skipped or repeated
    assert resumed_from >= 2 and resumed_from in [i for i, _ in list_checkpoints(run_dir / "checkpoints")]
    # The dead attempt's iterations after the checkpoint (at most save_interval) were trained again: the
    # file keeps their new records only, one per iteration.
    assert max(before) == resumed_from and before + after == list(range(1, after[-1] + 1))
    versions = [int(r["trainer/version"]) for r in iterations if r.get("trainer/restarts") == 1]
    # Versions go on past what the dead rank published: the workers never see a version twice.
    assert versions == sorted(versions) and versions[0] > max(
        int(r["trainer/version"]) for r in iterations if r.get("trainer/restarts") == 0
    )
    print(
        f"FIGURE trainer rank SIGKILL at iteration {max(before)}: restarted from checkpoint {resumed_from}, "
        f"next iteration logged {recovered_s:.0f}s after the kill, {len(after)} iterations after it"
    )
