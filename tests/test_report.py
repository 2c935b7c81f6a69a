"""The run report: PNGs drawn from metrics.jsonl, with data when there is some, "no data" otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mineonline_core.builtin.console import ConsoleLogger
from mineonline_core.errors import MineOnlineError
from mineonline_core.driver.report import read_metrics, write_report
from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS

TAB_BLUE = np.array([31, 119, 180])  # matplotlib's first line colour


def load_png(path):
    import imageio.v3 as iio

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return iio.imread(path)[..., :3].astype(int)


def line_pixels(image, colour=TAB_BLUE):
    return int((np.abs(image - colour).sum(-1) < 30).sum())


def synthetic_run(run_dir, iterations=40):
    lg = ConsoleLogger(run_dir=str(run_dir))
    rng = np.random.default_rng(0)
    for it in range(1, iterations + 1):
        step = it * 2048
        lg.log_metrics({"rollout/env_steps_per_s": 900 + 50 * rng.standard_normal()}, step=step)
        lg.log_metrics(
            {
                "trainer/iteration": it,
                "trainer/policy_loss": 0.1 / it,
                "trainer/value_loss": 5.0 / it,
                "trainer/entropy": 2.0 - it / 40,
                "trainer/samples_per_s": 3000.0,
                "episode/return_mean": np.log1p(it),
                "episode/cow/return_mean": np.log1p(it) / 2,
                **{f"crafter/success/{n}": min(1.0, it / 40 * (i % 3) / 2) for i, n in enumerate(CRAFTER_ACHIEVEMENTS)},
                "crafter/score": it / 10,
            },
            step=step,
        )
    lg.log_video("video/worker_0", str(run_dir / "videos" / "a.mp4"), step=10)
    lg.finish()


def test_report_pngs_hold_the_curves(tmp_path, capsys):
    synthetic_run(tmp_path)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "trainer/po')  # a run killed mid-line: tolerated
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert len(series["episode/return_mean"][0]) == 40
    assert series["trainer/policy_loss"][0][:2] == [2048.0, 4096.0]
    paths = write_report(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["report_crafter.png", "report_learning_curve.png", "report_losses.png", "report_throughput.png"]
    for path in paths:
        image = load_png(path)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert line_pixels(image) > 150, path.name  # a plotted curve, not an empty axis
    assert not list(tmp_path.glob("*.tmp.png"))


def test_missing_metrics_give_no_data_plots(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "something/else": 1.0}) + "\n")
    paths = write_report(tmp_path)
    assert sorted(p.name for p in paths) == ["report_learning_curve.png", "report_losses.png", "report_throughput.png"]
    for path in paths:
        assert line_pixels(load_png(path)) < 20  # nothing plotted; the panel says "no data"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(write_report(empty)) == 3  # no metrics.jsonl at all: still no crash


def test_not_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(MineOnlineError, match="not a directory"):
        write_report(tmp_path / "nope")
