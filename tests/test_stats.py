"""EpisodeStatistics: window means, per-task stats, Crafter success rates and score, hub pushes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mineonline_core.contracts.logger import Logger, LoggerOptions
from mineonline_core.services.loggerhub import LoggerHub
from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS, crafter_score
from mineonline_core.rollout.stats import EpisodeStatistics


def episode(ret, length=10, task=None, achievements=None, truncated=False, disc=None):
    return {
        "return": ret,
        "discounted_return": ret * 0.5 if disc is None else disc,
        "length": length,
        "task": task,
        "achievements": achievements,
        "truncated": truncated,
        "stream": "0.0.0",
    }


def test_crafter_achievement_list_matches_the_installed_crafter():
    crafter = pytest.importorskip("crafter")
    import os

    import yaml

    with open(os.path.join(os.path.dirname(crafter.__file__), "data.yaml")) as f:
        assert sorted(yaml.safe_load(f)["achievements"]) == sorted(CRAFTER_ACHIEVEMENTS)
    assert len(CRAFTER_ACHIEVEMENTS) == 22


def test_crafter_score_against_hand_computation():
    # Success rates 100 %, 50 %, 25 % and 19 zeros: exp((ln 101 + ln 51 + ln 26 + 19 ln 1) / 22) - 1
    rates = [100.0, 50.0, 25.0] + [0.0] * 19
    assert crafter_score(rates) == pytest.approx(0.7101701174166728, rel=1e-12)
    assert crafter_score([0.0] * 22) == 0.0
    assert crafter_score([100.0] * 22) == pytest.approx(100.0)
    # The score weights rare achievements: 1 % on each beats 22 % on one.
    assert crafter_score([1.0] * 22) > crafter_score([22.0] + [0.0] * 21)


def test_window_means_and_crafter_rates():
    stats = EpisodeStatistics(logger_hub=None, window=4, report_every=100)
    none = {name: 0 for name in CRAFTER_ACHIEVEMENTS}
    # An old episode that leaves the window: its achievement must not count.
    stats.add_episodes([episode(100.0, achievements={**none, "collect_diamond": 1})])
    eps = [
        episode(1.0, 10, achievements={**none, "collect_wood": 3, "place_table": 1, "wake_up": 1}),
        episode(2.0, 20, achievements={**none, "collect_wood": 1, "place_table": 2}),
        episode(3.0, 30, achievements={**none, "collect_wood": 5}, truncated=True),
        episode(6.0, 40, achievements={**none, "collect_wood": 1}),
    ]
    stats.add_episodes(eps)
    s = stats.summary()
    assert s["episode/count"] == 5.0  # every episode seen
    assert s["episode/return_mean"] == pytest.approx(3.0)  # window of the last 4
    assert s["episode/length_mean"] == pytest.approx(25.0)
    assert s["episode/discounted_return_mean"] == pytest.approx(1.5)
    assert s["episode/truncated_frac"] == pytest.approx(0.25)
    assert s["episode/return_max"] == 6.0 and s["episode/return_min"] == 1.0
    assert s["crafter/success/collect_wood"] == 1.0
    assert s["crafter/success/place_table"] == 0.5
    assert s["crafter/success/wake_up"] == 0.25
    assert s["crafter/success/collect_diamond"] == 0.0
    assert sum(k.startswith("crafter/success/") for k in s) == 22
    assert s["crafter/score"] == pytest.approx(0.7101701174166728, rel=1e-9)
    assert s["crafter/achievements_per_episode"] == pytest.approx((3 + 2 + 1 + 1) / 4)


def test_per_task_breakdown_and_no_crafter_keys_without_achievements():
    stats = EpisodeStatistics(window=10, report_every=100)
    stats.add_episodes(
        [episode(1.0, task="hunt cow"), episode(3.0, task="hunt cow"), episode(10.0, task="mine/log"), episode(0.0)]
    )
    s = stats.summary()
    assert s["episode/hunt_cow/return_mean"] == 2.0 and s["episode/hunt_cow/count"] == 2.0
    assert s["episode/mine_log/return_mean"] == 10.0 and s["episode/mine_log/count"] == 1.0
    assert s["episode/return_mean"] == pytest.approx(3.5)
    assert not any(k.startswith("crafter/") for k in s)


def test_pushes_to_hub_every_report_every_episodes(tmp_path):
    class Rec(Logger):
        name = "rec"

        def __init__(self, **kw):
            super().__init__(**kw)
            self.metrics, self.hists = [], []

        def log_metrics(self, metrics, step):
            self.metrics.append((metrics, step))

        def log_histogram(self, key, values, step):
            self.hists.append((key, len(values)))

    hub = LoggerHub(run_dir=str(tmp_path), loggers=[(Rec, LoggerOptions())], config={}, num_iterations=1, video_dir="v")
    stats = EpisodeStatistics(logger_hub=hub, window=5, report_every=3)
    hub.add_env_steps(77)
    stats.add_episodes([episode(float(i)) for i in range(7)])  # reports after episodes 3 and 6
    hub.finish()
    rec = hub._loggers[0]
    assert len(rec.metrics) == 2
    first, second = rec.metrics[0][0], rec.metrics[1][0]
    assert first["episode/count"] == 3.0 and first["episode/return_mean"] == 1.0
    assert second["episode/count"] == 6.0 and second["episode/return_mean"] == pytest.approx(np.mean([1, 2, 3, 4, 5]))
    assert rec.metrics[0][1] == 77  # stamped with the hub's env steps
    assert rec.hists == [("episode/return", 3), ("episode/return", 5)]
    assert math.isfinite(first["episode/return_std"])


def test_the_last_report_to_a_plain_hub_starts_no_ray(tmp_path):
    """The manager's report waits for an actor hub's calls; a plain hub has logged them when ``report`` returns,
    and waiting on no reference at all (``ray.get([])``) would start a local Ray instance."""
    import ray

    hub = LoggerHub(run_dir=str(tmp_path), loggers=[], config={}, num_iterations=1, video_dir="v")
    stats = EpisodeStatistics(logger_hub=hub, window=5, report_every=10)
    stats.add_episodes([episode(1.0), episode(3.0)])
    assert stats.report()["episode/return_mean"] == 2.0
    hub.finish()
    assert not ray.is_initialized()
