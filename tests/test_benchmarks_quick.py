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
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
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
    assert row["env_steps_ratio_vs_plain"] == pytest.approx(
        mine["env_steps_per_s"] / row["plain"]["env_steps_per_s"], rel=1e-3
    )


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


@pytest.mark.slow
def test_gpu_quick() -> None:
    """bench_gpu.py's CPU smoke run: one JSON line per part, in order, the GPU-only part skipped with its reason."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "WANDB_MODE": "disabled",
    }
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_gpu.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["part"] for r in records] == [
        "source",
        "machine",
        "precision",
        "trainer",
        "network",
        "run",
        "run_bf16",  # run_fp16 runs when named: two end-to-end runs fit a GPU call's budget
    ], proc.stdout[-3000:]
    parts = {r["part"]: r for r in records}
    assert all(r["bench"] == "gpu" and r["quick"] is True and "error" not in r for r in records), proc.stdout[-3000:]
    if parts["machine"]["cuda_available"]:
        pytest.skip("a CUDA machine runs the GPU parts, not the smoke run's")
    assert parts["network"]["skipped"] == parts["run_bf16"]["skipped"] == "no CUDA"
    assert parts["precision"]["reference"] is True  # the flagship's KL reference
    for name, row in parts["precision"]["settings"].items():
        assert "error" not in row, (name, row)
        assert (
            0 <= row["frac_clipped"] <= row["frac_ratio_off_2pct"] <= 1
            and row["logprob_err_max"] >= row["logprob_err_mean"] >= 0
        )
    amp = parts["precision"]["settings"]["amp"]
    assert amp["autocast_dtype"] == amp["rollout_dtype"] == "bfloat16"  # rollout computes as training does
    assert parts["precision"]["settings"]["before_amp_fp32_rollout"]["rollout_dtype"] is None
    for name, row in parts["trainer"]["configs"].items():
        assert "error" not in row, (name, row)
        assert row["trained_frames_per_s"] > 0 and row["estimate_ms_per_iteration"] > 0 and row["skipped_updates"] == 0
    assert (
        parts["trainer"]["configs"]["amp_2x"]["batch_size_per_gpu"]
        == 2 * parts["trainer"]["configs"]["amp"]["batch_size_per_gpu"]
    )
    run = parts["run"]
    assert run["rc"] == 0 and run["iterations"] == 2 and run["gpu"] == "skipped: no CUDA", run
    assert 0 < run["first_iteration_s"] < run["wall_s"] and run["trained_frames_per_wall_s_steady"] > 0
    assert 0 < run["first_record_s"] <= run["first_env_steps_s"] <= run["first_iteration_s"], run
    assert {"perf/broadcast_ms", "perf/gae_ms", "perf/train_ms"} <= set(run["trainer_perf_ms_median"])


def test_suite_cpu_quick_charges_each_child_to_its_test() -> None:
    """Two children, each burning one CPU-second under its own ``PYTEST_CURRENT_TEST``: each is charged to
    its test (less the last sampling period at most), nothing to the other."""
    r = run_quick("bench_suite_cpu.py")
    tests = dict(r["top"])
    assert r["exit_code"] == 0 and set(tests) >= {"tests/a.py::one", "tests/b.py::two"}, r
    for name in ("tests/a.py::one", "tests/b.py::two"):
        cpu, processes = tests[name]
        assert 0.4 <= cpu <= 1.3 and processes == 1, (name, r)
    assert r["run_cpu_s"] <= r["machine_busy_cpu_s"] + 0.5, r
