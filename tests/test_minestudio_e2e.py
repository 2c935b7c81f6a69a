"""The flagship path: MineStudio's cow example (``examples/minestudio_cow.py``) trained by ``mineonline
run`` on MineStudio's real ``MinecraftSim`` over the fake engine, with small random VPT weights in place
of the released files: LMDB store, KL to the reference policy, videos, episode returns and
``kill_entity`` achievements in the metrics, then ``--resume``. ``benchmarks/bench_minestudio.py``
times the same run for ``make bench``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(os.environ.get("MINEONLINE_VPT_FIXTURES") or ROOT.parent / "shared" / "fixtures") / "vpt_public"
CONFIG = ROOT / "benchmarks" / "minestudio_cow_fake.py"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (FIXTURE / "public.model").exists(), reason="the shared VPT fixture is not beside this checkout"
    ),
]


def cow_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    sys.path.insert(0, str(CONFIG.parent))
    try:
        from minestudio_cow_fake import SMALL
    finally:
        sys.path.remove(str(CONFIG.parent))
    env = {
        **os.environ,
        "VPT_MODEL": str(FIXTURE / "public.model"),
        "VPT_WEIGHTS": str(FIXTURE / "public.weights"),
        "COW_TIME_LIMIT": "30",
        "WANDB_MODE": "disabled",
    }
    command = [
        sys.executable,
        "-m",
        "mineonline_core.cli",
        "run",
        *args,
        *SMALL,
        f"output_dir={tmp_path}",
        "--no-progress",
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def test_cow_example_trains_reports_and_resumes(tmp_path: Path) -> None:
    first = cow_run(tmp_path, str(CONFIG), "run_name=cow", "train_config.num_iterations=2")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "cow"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer/iteration"] == 2 and summary["trainer/kl_ref"] > 0  # KL to the reference policy
    assert summary["episode/count"] > 0 and "episode/return_mean" in summary
    assert (
        list((run_dir / "videos").glob("*.mp4"))
        and (run_dir / "replay_buffer_cache" / "mineonline-store.json").exists()
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    best = max(r.get("episode/return_max", 0.0) for r in records)
    kills = max(r.get("achievement/success/kill_entity_cow", 0.0) for r in records)
    assert (best > 0) == (kills > 0)  # a cow kill is both the reward and the achievement

    resumed = cow_run(tmp_path, "--resume", str(run_dir), "train_config.num_iterations=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "checkpoint_000003").is_dir()
    iterations = [
        r["trainer/iteration"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "trainer/iteration" in r
    ]
    assert iterations[-1] == 3 and 3 not in iterations[:-1] and iterations.count(1) == 1
