"""``benchmarks/bench_gpu.py`` cannot waste a GPU's minutes (issue 33 item 8): each part runs in its own
process under its own cap and prints its line whatever the others did (a crash, a hang past the cap),
and the first line names the wheels' commit and refuses a call whose installed code is not the
checkout's. Run on the CPU with the two self-test parts, which crash and hang on purpose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _gpusource import source_check  # noqa: E402


def test_a_crashed_and_a_hung_part_leave_the_others_their_lines() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_gpu.py"),
            "--parts",
            "selftest_crash,selftest_hang,machine",
            "--cap",
            "selftest_hang=6",
            # A child's start (torch and the project imported) takes 15 s on this 2-core machine under load:
            # the crash and the machine part get room for it, so that only the hang runs out of time.
            "--cap",
            "selftest_crash=120",
            "--cap",
            "machine=120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["part"] for r in records] == ["source", "selftest_crash", "selftest_hang", "machine"], proc.stdout
    source, crash, hang, machine = records
    assert source["ok"] is True and source["installed"] == "editable (the checkout)"
    assert crash["error"] == "rc 1" and "RuntimeError: selftest_crash" in crash["stderr_tail"]
    assert hang["error"] == "timed out"
    assert "error" not in machine and machine["cuda_available"] in (True, False)


def _tree(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return {rel: root / rel for rel in files}


def test_the_source_line_refuses_wheels_that_are_not_the_checkout(tmp_path: Path) -> None:
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    code = {"mineonline_core/__init__.py": "", "mineonline_core/trainer/update.py": "x = 1\n"}
    _tree(checkout, code)
    _tree(checkout, {"plugins/ppo/mineonline_ppo.py": "y = 2\n"})
    installed = {
        "mineonline-core": _tree(site, code),
        "mineonline-ppo": _tree(site, {"mineonline_ppo.py": "y = 2\n"}),
    }
    same = source_check(installed=installed, root=checkout, wheels_commit="abc", checkout_commit=None)
    assert same["ok"] is True and same["wheels_commit"] == "abc"

    (checkout / "plugins/ppo/mineonline_ppo.py").write_text("y = 3\n")  # an uncommitted fix
    (checkout / "mineonline_core/trainer/build.py").write_text("")  # a file added since the wheels
    stale = source_check(installed=installed, root=checkout, wheels_commit="abc", checkout_commit=None)
    assert stale["ok"] is False
    assert "plugins/ppo/mineonline_ppo.py" in stale["error"] and "mineonline_core/trainer/build.py" in stale["error"]
    assert "built from abc" in stale["error"]

    (checkout / "plugins/ppo/mineonline_ppo.py").write_text("y = 2\n")
    (checkout / "mineonline_core/trainer/build.py").unlink()
    moved = source_check(installed=installed, root=checkout, wheels_commit="abc", checkout_commit="def")
    assert moved["ok"] is False and "checkout is at def" in moved["error"]


def test_the_parts_caps_fit_eight_minutes_with_the_wheel_install() -> None:
    import bench_gpu

    assert set(bench_gpu.CAPS) == set(bench_gpu.PARTS)
    assert sum(bench_gpu.CAPS[p] for p in bench_gpu.DEFAULT_PARTS) <= bench_gpu.BUDGET_S <= 8 * 60 - 30
    assert {"run", "run_bf16", "run_fp16"} <= set(bench_gpu.PARTS)
    assert bench_gpu.AMP_RUNS["run_fp16"] == ["train_config.use_amp=true", "train_config.amp_dtype=float16"]


def test_a_trainer_row_that_would_pass_the_parts_deadline_is_skipped_not_cut() -> None:
    # The trainer line is printed after its last row: a row cut by the cap would lose every row before it.
    import bench_gpu

    now = [0.0]
    ran = []

    def row(name: str) -> dict:
        ran.append(name)
        now[0] += {"fp32": 40.0, "tf32": 30.0, "amp": 20.0, "amp_2x": 20.0}[name]
        if name == "tf32":
            raise RuntimeError("CUDA error")  # a row that fails is a figure, and still times the next
        return {"frames": 1}

    rows = bench_gpu.rows_within(["fp32", "tf32", "amp", "amp_2x"], row, deadline=100.0, clock=lambda: now[0])
    assert ran == ["fp32", "tf32", "amp"]  # amp: 70 s + tf32's 30 fits 100; amp_2x: 90 s + 20 does not
    assert rows["fp32"] == {"frames": 1} and rows["tf32"]["error"] == "RuntimeError: CUDA error"
    assert "skipped" in rows["amp_2x"] and now[0] == 90.0


def test_the_run_parts_figures_split_the_start_up_also_without_an_iteration() -> None:
    """A run capped before its first iteration (the 65 s caps on the H200) still says where its start-up went;
    the figures are computed by hand from four records (``time`` is wall time, the command started at 0)."""
    from _gpulib import run_figures

    records = [
        {"time": 10.0, "step": 0},
        {"time": 14.0, "step": 256, "perf/inference_server_ms": 30.0, "rollout/inference_batch_mean": 32.0},
        {
            "time": 20.0,
            "step": 4096,
            "trainer/iteration": 1.0,
            "trainer/samples_per_s": 1000.0,
            "perf/train_ms": 2000.0,
        },
        {
            "time": 25.0,
            "step": 8192,
            "trainer/iteration": 2.0,
            "trainer/samples_per_s": 3000.0,
            "perf/train_ms": 1000.0,
        },
    ]
    assert run_figures(records[:2], 0.0) == {"iterations": 0, "first_record_s": 10.0, "first_env_steps_s": 14.0}
    out = run_figures(records, 0.0)
    assert (out["first_record_s"], out["first_env_steps_s"], out["first_iteration_s"]) == (10.0, 14.0, 20.0)
    assert out["trained_frames_per_wall_s_steady"] == 3000.0 * 1.0 / 5.0  # the second iteration's frames over 5 s
    assert out["rollout_env_frames_per_s_steady"] == (8192 - 4096) / 5.0
    assert (out["rollout_inference_server_ms_median"], out["rollout_inference_batch_mean_median"]) == (30.0, 32.0)
