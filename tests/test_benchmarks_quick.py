"""Smoke runs of the benchmark scripts (``--quick``): each prints one JSON line with its figures.

No timed assertions: the figures are checked for presence and sanity (positive rates, ratios of
the right kind, zero-copy delivery), never against a speed. Scripts that start a whole run on Ray
are marked ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def run_quick(script: str, *extra: str, timeout: float = 300) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, str(BENCH / script), "--quick", *extra], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-3000:]
    record = json.loads(lines[0])
    for key in ("bench", "date", "host_cpus", "load_1m", "quick"):
        assert key in record
    assert record["quick"] is True
    return record


def test_plain_ppo_quick() -> None:
    r = run_quick("plain_ppo.py")
    assert r["bench"] == "plain_ppo" and r["workload"] == "cartpole"
    assert r["env_steps"] == 3 * 8 * 128  # warm-up + 2 iterations of 8 envs x 128 steps
    assert r["env_steps_per_s"] > 0 and r["samples_per_s"] == pytest.approx(4 * r["env_steps_per_s"], rel=1e-3)
    assert 0 < sum(r["time_split"].values()) <= 1.0001
    assert set(r["last_losses"]) == {"policy_loss", "value_loss", "entropy"}


def test_collection_quick_without_ray() -> None:
    r = run_quick("bench_collection.py", "--modes", "ceiling,collector")
    assert r["errors"] == {}
    assert r["ceiling_steps_per_s"] > 0 and r["collector_steps_per_s"] > 0
    assert r["ratio_collector"] == pytest.approx(r["collector_steps_per_s"] / r["ceiling_steps_per_s"], rel=1e-3)
    perf = r["collector_detail"]["perf"]
    assert perf["perf/inference_batch"] == 2.0  # batch_size = num_envs = 2
    assert {"perf/env_step_ms", "perf/inference_ms", "perf/fragment_ms"} <= set(perf)


def test_broadcast_quick() -> None:
    r = run_quick("bench_broadcast.py")
    assert r["all_zero_copy"] is True  # workers map the object store's buffer, they do not copy it
    (row,) = r["rows"]
    assert row["params"] == 1_000_000 and row["workers"] == 2
    assert row["deliver_ms"] > 0 and row["baseline_ms"] > 0
    assert row["ratio"] == pytest.approx(row["deliver_ms"] / row["baseline_ms"], rel=1e-3)
    assert r["worst_ratio"] == row["ratio"]


@pytest.mark.slow
def test_collection_quick_real_actor() -> None:
    r = run_quick("bench_collection.py", "--modes", "ceiling,actor")
    assert r["errors"] == {}
    assert r["actor_steps_per_s"] > 0 and r["ratio_actor"] > 0
    assert r["actor_detail"]["buffer"]["replay/fragments_added"] > 0


@pytest.mark.slow
def test_e2e_quick() -> None:
    r = run_quick("bench_e2e.py", timeout=600)
    row = r["results"]["cartpole"]
    assert "error" not in row["mineonline"], row["mineonline"]
    mine = row["mineonline"]
    assert mine["env_steps_per_s"] > 0 and mine["samples_per_s"] > 0
    assert any(k.startswith("perf/") for k in mine["profile"])
    assert row["env_steps_ratio_vs_plain"] == pytest.approx(mine["env_steps_per_s"] / row["plain"]["env_steps_per_s"], rel=1e-3)


@pytest.mark.slow
def test_memory_quick() -> None:
    r = run_quick("bench_memory.py", timeout=600)
    assert r["error"] is None
    # One CPU rank trains in the driver's process (train_config.use_ray_train), so no rank process exists.
    for role in ("driver", "rollout_worker"):
        assert r["peak_rss_mib"][role] > 0
    assert len(r["series"]["t_s"]) >= 2


@pytest.mark.slow
def test_startup_quick() -> None:
    r = run_quick("bench_startup.py")
    (run,) = r["runs"]
    assert "error" not in run, run
    assert 0 < run["first_env_step_s"] <= run["first_iteration_s"] <= run["final_checkpoint_s"] < run["whole_s"]
    assert run["iterations"] == 2 and run["noise_lines"] == 0
