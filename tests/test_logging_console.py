"""ConsoleLogger's metrics.jsonl and summary, and the driver's Progress display."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from mineonline_core.builtin.console import ConsoleLogger
from mineonline_core.driver.progress import Progress, format_eta, summary_table


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_histograms_videos_and_summary(tmp_path, capsys):
    lg = ConsoleLogger(run_dir=str(tmp_path), config={"seed": 3})
    lg.log_metrics({"trainer/policy_loss": 0.25, "episode/return_mean": 3.0}, step=100)
    lg.log_metrics({"trainer/policy_loss": float("nan"), "trainer/grad_norm": float("inf")}, step=200)
    lg.log_histogram("trainer/advantages", np.array([1.0, 3.0, np.nan]), step=200)
    lg.log_histogram("trainer/empty", np.array([]), step=200)  # nothing to summarise: no line
    lg.log_video("video/worker_0", str(tmp_path / "videos" / "v.mp4"), step=300)
    lg.finish()
    lg.finish()  # second call is a no-op
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(records) == 4
    assert records[0]["step"] == 100 and records[0]["trainer/policy_loss"] == 0.25 and records[0]["time"] > 0
    assert records[1]["trainer/policy_loss"] is None and records[1]["trainer/grad_norm"] is None  # valid JSON
    assert records[2] == {
        "step": 200,
        "time": records[2]["time"],
        "trainer/advantages/mean": 2.0,
        "trainer/advantages/std": 1.0,
    }
    assert records[3]["video"] == "video/worker_0" and records[3]["path"] == "videos/v.mp4"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["episode/return_mean"] == 3.0 and summary["env_steps"] == 300
    assert capsys.readouterr().out == ""  # the driver prints the table, not the logging actor


def test_jsonl_appends_on_resume(tmp_path):
    for step in (1, 2):
        lg = ConsoleLogger(run_dir=str(tmp_path))
        lg.log_metrics({"x": float(step)}, step=step)
        lg.finish()
    assert [r["x"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0]


def test_summary_table_groups_by_namespace():
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=120).print(
        summary_table({"trainer/a": 1.5, "trainer/b": 2.0, "episode/return_mean": 1234567.0}, env_steps=42)
    )
    text = buf.getvalue()
    assert text.count("trainer") == 1  # the group name is printed once
    assert "1,234,567" in text and "42" in text


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_plain_lines_when_not_a_tty():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, file=out, interval_s=10.0, clock=clock)
    assert not p.tty
    p.update(
        {
            "trainer/iteration": 2,
            "env_steps": 2048,
            "rollout/env_steps_per_s": 512.0,
            "episode/return_mean": 1.5,
            "replay/staleness_mean": 0.5,
            "trainer/policy_loss": 0.02,
        }
    )
    clock.t = 5.0
    p.update({"trainer/iteration": 3, "env_steps": 3072})  # within the interval: no line
    clock.t = 20.0
    p.update({"trainer/iteration": 6, "env_steps": 6144, "trainer/samples_per_s": 100.0, "logger/errors": 1.0})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "iter 2/10 | env_steps 2,048 | env steps/s (rollout) 512 | return mean 1.5 | staleness mean 0.5 "
        "| policy loss 0.02"
    )
    # 4 iterations in 20 s since the first one seen -> 5 s each, 4 left -> 20 s
    assert "iter 6/10" in lines[1] and "samples/s (train) 100" in lines[1] and "ETA 0:20" in lines[1]
    assert "logger errors 1" in lines[1]
    p.close()
    assert len(out.getvalue().splitlines()) == 3
    p.update({"trainer/iteration": 7})  # closed: ignored
    assert len(out.getvalue().splitlines()) == 3


def test_a_resumed_run_shows_its_checkpoints_iteration_until_the_first_record():
    """Before the resumed trainer's first record the line said ``iter 0/N``, as if the run had restarted."""
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, file=out, interval_s=10.0, clock=clock, start_iteration=6)
    p.update({"env_steps": 6144})
    assert out.getvalue().startswith("iter 6/10 | env_steps 6,144")
    clock.t = 20.0
    p.update({"trainer/iteration": 7, "env_steps": 7168})
    assert out.getvalue().splitlines()[-1].startswith("iter 7/10")
    p.close()


def test_progress_eta_and_disabled():
    clock = FakeClock()
    p = Progress(100, file=io.StringIO(), clock=clock)
    assert p.eta_s() is None  # no iteration seen
    p.update({"trainer/iteration": 10})
    assert p.eta_s() is None  # no rate yet
    clock.t = 30.0
    p.update({"trainer/iteration": 20})
    assert p.eta_s() == pytest.approx(3.0 * 80)
    p.update({"trainer/iteration": 100})
    assert p.eta_s() == 0.0
    assert format_eta(3725) == "1:02:05" and format_eta(65) == "1:05" and format_eta(None) == "?"
    out = io.StringIO()
    off = Progress(5, enabled=False, file=out)
    off.update({"trainer/iteration": 1})
    off.close()
    assert out.getvalue() == ""


def test_progress_live_panel_on_a_terminal():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(4, file=out, clock=clock, force_terminal=True)
    assert p.tty
    p.update({"trainer/iteration": 1, "env_steps": 100, "episode/return_mean": 2.0, "trainer/value_loss": 0.3})
    p.close()
    text = out.getvalue()
    assert "iter 1/4" in text and "return mean" in text and "value loss" in text


def test_progress_follows_max_env_steps_when_it_ends_the_run():
    # Crafter's demo: num_iterations 400 is an upper bound, max_env_steps ends the run near 245.
    out, clock = io.StringIO(), FakeClock()
    p = Progress(400, max_env_steps=1_000_000, file=out, interval_s=0.0, clock=clock)
    p.update({"trainer/iteration": 10, "env_steps": 40_960})
    clock.t = 100.0
    p.update({"trainer/iteration": 20, "env_steps": 81_920})
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("iter 20 | env_steps 81,920/1,000,000") and "/400" not in line
    assert p.done_fraction() == pytest.approx(0.08192)
    # 40,960 steps in 100 s -> 918,080 left take 2241 s (the iteration rate would say 3800 s).
    assert p.eta_s() == pytest.approx(100.0 / 0.04096 * (1 - 0.08192))
    p.update({"trainer/iteration": 245, "env_steps": 1_003_520})
    assert p.eta_s() == 0.0 and p.done_fraction() == 1.0
    # Iterations ahead of the env-step budget: the iteration budget ends the run and is shown.
    q = Progress(10, max_env_steps=1_000_000, file=io.StringIO(), clock=clock)
    q.update({"trainer/iteration": 5, "env_steps": 1_000})
    assert q.line().startswith("iter 5/10 | env_steps 1,000") and q.done_fraction() == 0.5
