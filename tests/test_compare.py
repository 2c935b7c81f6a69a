"""``mineonline report RUN RUN ...`` on real run directories: two seeds of one config aggregated into a
mean with a 95 % band, a third run with another learning rate beside them, run names in the legend,
and no zig-zag where steps repeat (the later record wins)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mineonline_core.driver.api import run
from mineonline_core.driver.compare import aggregate, group_runs, load_run, t975, write_comparison
from mineonline_core.driver.report import RETURN_KEY, read_metrics
from tests.test_report import load_png
from tests.conftest import small_cartpole_run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = small_cartpole_run(
    policy_config={"hidden_sizes": [16]},
    rollout_config={"episode_statistics_config": {"window": 5}},
    train_config={"num_iterations": 2, "save_interval": 1, "keep_interval": 1, "learning_rate": 1e-3},
)


def _run(root: Path, name: str, **changes: object) -> Path:
    config = json.loads(json.dumps(CONFIG))
    config["train_config"].update(changes.pop("train", {}))
    result = run({**config, **changes, "run_name": name, "output_dir": str(root)}, progress=False)
    assert result["status"] == "completed", result
    return root / name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "a": _run(root, "lr1e-3-s0", seed=0),
        "b": _run(root, "lr1e-3-s1", seed=1),
        "c": _run(root, "lr3e-3-s0", seed=0, train={"learning_rate": 3e-3}),
    }


def test_repeated_steps_do_not_zig_zag(runs: dict[str, Path], tmp_path: Path) -> None:
    # A run's file as an attempt that went back leaves it (a resume from an older checkpoint in a run
    # directory written before resumes truncated metrics.jsonl, or two records at one step): the
    # steps go back, and the later records win from there on.
    lines = (runs["a"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    first = next(r for r in records if "trainer/iteration" in r)
    again = {**first, "trainer/iteration": 99.0}
    (tmp_path / "metrics.jsonl").write_text("\n".join([*lines, json.dumps(again)]) + "\n")
    xs, ys = read_metrics(tmp_path / "metrics.jsonl")["trainer/iteration"]
    assert xs == [first["step"]] and ys == [99.0]  # everything from the repeated step on is the later record
    clean = read_metrics(runs["a"] / "metrics.jsonl")
    assert all(all(b > a for a, b in zip(xs, xs[1:])) for xs, _ in clean.values())
    # In a clean file only a step logged twice drops the earlier record: two iterations can end at one
    # env-step count when the workers had not reported new steps in between (seen on a loaded machine).
    its = [(r["step"], r["trainer/iteration"]) for r in records if "trainer/iteration" in r]
    assert [y for _, y in its] == [1.0, 2.0] and its[0][0] <= its[1][0]
    kept = [y for (x, y), (later, _) in zip(its, [*its[1:], (math.inf, None)]) if later > x]
    assert clean["trainer/iteration"][1] == kept and kept[-1] == 2.0


def test_seeds_are_aggregated_and_runs_overlaid(runs: dict[str, Path], tmp_path: Path) -> None:
    loaded = [load_run(runs[k]) for k in ("a", "b", "c")]
    groups = group_runs(loaded)
    assert [[r.name for r in g] for g in groups] == [["lr1e-3-s0", "lr1e-3-s1"], ["lr3e-3-s0"]]
    seeds = aggregate(groups[0], RETURN_KEY)
    assert seeds is not None and seeds.label == "seeds (n=2: lr1e-3-s0, lr1e-3-s1)"
    both = np.stack([np.interp(seeds.steps, *r.series[RETURN_KEY]) for r in groups[0]])
    assert np.allclose(seeds.mean, both.mean(0))
    assert np.allclose(np.subtract(seeds.high, seeds.mean), t975(2) * both.std(0, ddof=1) / np.sqrt(2))
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "report", *map(str, runs.values()), "--output", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    image = load_png(tmp_path / "compare_episode_return_mean.png")
    assert image.shape[0] > 300 and image.shape[1] > 500
    table = (tmp_path / "compare.txt").read_text().splitlines()
    assert len(table) == 3 and "seeds (n=2: lr1e-3-s0, lr1e-3-s1)" in table[1] and "(95% CI)" in table[1]
    assert table[2].split("\t")[1] == "lr3e-3-s0"


def test_logger_config_group_groups_runs(runs: dict[str, Path], tmp_path: Path) -> None:
    loaded = [load_run(runs[k]) for k in ("a", "c")]
    for run_ in loaded:
        run_.config.setdefault("logger_config", {})["group"] = "sweep-1"
    (group,) = group_runs(loaded)
    curve = aggregate(group, RETURN_KEY)
    assert curve is not None and curve.label == "sweep-1 (n=2: lr1e-3-s0, lr3e-3-s0)"
    assert write_comparison([runs["a"]], output=tmp_path)[-1].read_text().splitlines()[1].split("\t")[1] == "lr1e-3-s0"
