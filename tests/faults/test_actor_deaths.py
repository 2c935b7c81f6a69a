"""The run's bookkeeping actors SIGKILLed one after another during one real ``mineonline run`` (CartPole, the
LMDB store, a shared inference server): the episode statistics, the replay store host, the logging actor
and the inference server.

Ray restarts each in place (same name, so no replacement collides with the dead one's name, and every
handle to it still works). Each restarted actor names the death on the console and in ``run.log``, and
counts it (``stats/restarts``, ``storehost/restarts``, ``logging/restarts``, ``rollout/inference_restarts`` in
``metrics.jsonl``); the run
goes on training (an iteration after each death) and stops cleanly on Ctrl-C, never as "Training failed".
After the logging actor's restart ``metrics.jsonl`` still has one record per iteration and a step axis
that never goes back. One run for the three deaths: each costs a Ray start-up otherwise. The test waits
for events (the messages, the metrics, the next iteration), each under a generous bound that names it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mineonline_core.testing.faults import live_records
from mineonline_core.testing.procs import descendants, reap_session

ROOT = Path(__file__).resolve().parents[2]
RUN = "actor-deaths"
CONFIG = {
    "run_name": RUN,
    "seed": 0,
    # Not paced as the other fault runs are (mineonline_core.testing.envs): its trainer trains on reused chunks
    # (max_reuse out of reach) whatever the env's pace.
    "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 16,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        # Chunks are never used up or stale, so the store holds records whenever its host is killed (after
        # iteration 2): with the defaults a trainer faster than rollout (a busy machine) drops each chunk as it
        # trains on it, and the store can be empty at the kill, whatever the restarted host does.
        "replay_buffer_config": {
            "max_chunks": 64,
            "fragments_per_chunk": 1,
            "max_reuse": 1_000_000,
            "max_staleness": 1_000_000,
        },
        "episode_statistics_config": {"window": 5},
        "inference": "shared",  # the shared inference server: one more actor Ray restarts
    },
    "train_config": {
        "num_workers": 1,
        "num_cpus_per_worker": 0.5,
        "num_iterations": 100_000,  # stopped with Ctrl-C once every death was survived
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "batch_size_per_gpu": 2,
        "context_length": 16,
        "epochs_per_iteration": 1,
        "save_interval": 1000,
        "keep_interval": 1000,
    },
}
# The actor's class (its process title is ``ray::Class...``), the metric its restart is counted in, and the
# words its restart is named with on the console and in run.log.
DEATHS = [
    ("EpisodeStatistics", "stats/restarts", f"the episode statistics actor {RUN}/episode_statistics died"),
    ("StoreHost", "storehost/restarts", f"the replay store host {RUN}/store_host died"),
    ("LoggerHub", "logging/restarts", f"the logging actor {RUN}/logger_hub died"),
    ("InferenceServer", "rollout/inference_restarts", f"the inference server {RUN}/inference_server died"),
]


def _iterations(run_dir: Path) -> list[int]:
    return [int(r["trainer/iteration"]) for r in live_records(run_dir) if "trainer/iteration" in r]


def _actor_pid(driver: int, cls: str) -> int | None:
    found = [pid for pid, cmd in descendants(driver).items() if cmd.startswith(f"ray::{cls}")]
    return found[0] if len(found) == 1 else None


def test_killed_bookkeeping_actors_are_restarted_named_and_counted(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / RUN
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(tmp_path / "runs")}))
    console_path = tmp_path / "console.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    with open(console_path, "w") as console:
        driver = subprocess.Popen(
            [sys.executable, "-m", "mineonline_core.cli", "run", str(config), "--no-progress"],
            cwd=ROOT,
            env=env,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_for(predicate, what: str, timeout: float = 300.0):
        end = time.monotonic() + timeout
        while not (value := predicate()):
            assert driver.poll() is None, f"the run ended waiting for {what}:\n" + console_path.read_text()[-4000:]
            assert time.monotonic() < end, f"{what} not within {timeout:.0f} s:\n" + console_path.read_text()[-3000:]
            time.sleep(0.5)  # polling the run's files and processes
        return value

    figures = []
    try:
        wait_for(lambda: len(_iterations(run_dir)) >= 2, "iteration 2")
        for cls, metric, words in DEATHS:
            pid = wait_for(lambda cls=cls: _actor_pid(driver.pid, cls), f"the {cls} process")
            os.kill(pid, signal.SIGKILL)
            killed_at, reached = time.monotonic(), max(_iterations(run_dir))
            wait_for(lambda words=words: words in (run_dir / "run.log").read_text(), f"{words!r} in run.log")
            named_s = time.monotonic() - killed_at
            # Logged by the restarted actor as it starts (the server's with its next report): seconds after the
            # message, so a bound shorter than the others' (a defect that drops it costs the check less time).
            wait_for(
                lambda metric=metric: any(r.get(metric) == 1.0 for r in live_records(run_dir)),
                f"{metric} = 1",
                timeout=120,
            )
            wait_for(lambda reached=reached: max(_iterations(run_dir)) > reached, f"an iteration after the {cls} death")
            figures.append(
                f"{cls} named {named_s:.1f}s after the kill, next iteration {time.monotonic() - killed_at:.0f}s"
            )
        os.kill(driver.pid, signal.SIGINT)
        code = driver.wait(timeout=300)
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
    output = console_path.read_text()
    assert code == 130 and f"run {RUN} interrupted" in output, output[-4000:]  # stopped by Ctrl-C, not failed
    assert "Training failed" not in output and "restart(s)" not in output, output[-4000:]
    run_log = (run_dir / "run.log").read_text()
    for cls, metric, words in DEATHS:
        assert words in output and words in run_log, (cls, output[-4000:])
        assert f"(restart 1, {metric})" in output  # the console says which metric counts it
    records = live_records(run_dir)
    iterations = [int(r["trainer/iteration"]) for r in records if "trainer/iteration" in r]
    assert iterations == list(range(1, iterations[-1] + 1))  # one record per iteration, across the hub's restart
    # The restarted store host reopened the LMDB store with the records the run had stored (never cleared it):
    # no record lost, so no chunk refused.
    kept = re.search(r"reopened the store at \S+ with its (\d+) records", run_log)
    assert kept and int(kept.group(1)) > 0, run_log[-3000:]
    assert {r.get("trainer/corrupt_fragments") for r in records if "trainer/iteration" in r} == {0.0}
    steps = [r["step"] for r in records]
    assert steps == sorted(steps), "the step axis of metrics.jsonl went back"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary.get("logging/restarts") == 1.0
    assert reap_session(driver.pid, grace_s=60) == {}
    print("FIGURE bookkeeping actor deaths: " + "; ".join(figures) + f"; {iterations[-1]} iterations, exit 130")
