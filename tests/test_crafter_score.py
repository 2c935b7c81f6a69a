"""The Crafter score by the paper's rule (Hafner 2021): success rates over ALL training episodes up to
the budget, ``exp(mean_a ln(1 + s_a)) - 1``; kept by ``EpisodeStatistics``, read by ``bench_learning``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS
from mineonline_core.rollout.stats import EpisodeStatistics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_learning  # noqa: E402

NONE = dict.fromkeys(CRAFTER_ACHIEVEMENTS, 0)


def crafter_episode(**unlocked: int) -> dict:
    return {
        "return": float(sum(unlocked.values())),
        "discounted_return": 0.0,
        "length": 100,
        "task": None,
        "achievements": {**NONE, **unlocked},
        "truncated": False,
        "stream": "0.0.0",
    }


def test_all_episode_rates_and_score_count_every_episode_not_the_window() -> None:
    stats = EpisodeStatistics(window=2, report_every=100)
    stats.add_episodes(
        [
            crafter_episode(collect_wood=3, place_table=1),
            crafter_episode(collect_wood=1),
            crafter_episode(wake_up=1),
            crafter_episode(collect_wood=2, collect_diamond=1),
        ]
    )
    s = stats.summary()
    assert s["crafter/all_episodes/count"] == 4.0
    assert s["crafter/all_episodes/success/collect_wood"] == 0.75  # unlocked in 3 of 4 episodes, however often
    assert s["crafter/all_episodes/success/place_table"] == 0.25
    assert s["crafter/all_episodes/success/collect_diamond"] == 0.25
    assert s["crafter/all_episodes/success/eat_cow"] == 0.0
    assert sum(k.startswith("crafter/all_episodes/success/") for k in s) == 22
    # Rates 75, 25, 25, 25 % and 18 zeros: exp((ln 76 + 3 ln 26) / 22) - 1.
    assert s["crafter/all_episodes/score"] == pytest.approx(0.8986391771615581, rel=1e-12)
    # The window (last 2 episodes): 50 % on wake_up, collect_wood, collect_diamond: exp(3 ln 51 / 22) - 1.
    assert s["crafter/score"] == pytest.approx(0.7094266823632083, rel=1e-12)


def test_episodes_without_crafter_achievements_are_not_crafter_episodes() -> None:
    stats = EpisodeStatistics(window=10, report_every=100)
    stats.add_episodes(
        [
            crafter_episode(collect_wood=1),
            {**crafter_episode(), "achievements": {"kill_entity:cow": 1}},
            {**crafter_episode(), "achievements": None},
        ]
    )
    s = stats.summary()
    assert s["crafter/all_episodes/count"] == 1.0 and s["crafter/all_episodes/success/collect_wood"] == 1.0
    assert not any(k.startswith("crafter/") for k in EpisodeStatistics(window=3).summary())


def test_real_crafter_episodes_give_the_rates_crafter_reports() -> None:
    crafter = pytest.importorskip("crafter")
    from mineonline_core.contracts.envs import adapt_env
    from mineonline_core.builtin.envs import CrafterAchievements

    env = CrafterAchievements(adapt_env(crafter.Env(size=(32, 32), length=150, seed=3)))
    rng, stats, ends = np.random.default_rng(0), EpisodeStatistics(window=2, report_every=100), []
    for episode in range(6):
        env.reset(seed=episode)
        done, total, length = False, 0.0, 0
        while not done:
            _, reward, terminated, truncated, info = env.step(int(rng.integers(17)))
            total, length, done = total + float(reward), length + 1, terminated or truncated
        ends.append(info["achievements"])
        stats.add_episodes(
            [
                {
                    "return": total,
                    "discounted_return": 0.0,
                    "length": length,
                    "task": None,
                    "achievements": info["achievements"],
                    "truncated": bool(truncated),
                    "stream": "0.0.0",
                }
            ]
        )
    s = stats.summary()
    expected = {name: float(np.mean([end[name] > 0 for end in ends])) for name in CRAFTER_ACHIEVEMENTS}
    assert any(0 < rate for rate in expected.values())  # random play unlocks a few achievements
    assert {name: s[f"crafter/all_episodes/success/{name}"] for name in CRAFTER_ACHIEVEMENTS} == expected
    score = math.exp(sum(math.log(1 + 100 * r) for r in expected.values()) / 22) - 1
    assert s["crafter/all_episodes/score"] == pytest.approx(score, rel=1e-12)


def test_bench_scores_the_last_record_within_the_budget(tmp_path: Path) -> None:
    def record(step: int, count: int, **rates: float) -> dict:
        success = {f"crafter/all_episodes/success/{name}": rates.get(name, 0.0) for name in CRAFTER_ACHIEVEMENTS}
        return {"step": step, "crafter/all_episodes/count": count, **success, "crafter/all_episodes/score": -1.0}

    lines = [
        {"step": 500, "trainer/policy_loss": 0.1},
        record(1000, 10, collect_wood=0.5),
        record(2000, 20, collect_wood=1.0, collect_sapling=0.5),
        {"step": 2400, "trainer/policy_loss": 0.1},
        record(3000, 30, collect_wood=1.0, collect_sapling=1.0, place_plant=1.0),  # after the budget
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = bench_learning.paper_crafter_score(path, budget=2500)
    assert result["episodes"] == 20 and result["at_env_step"] == 2000
    assert result["success"]["collect_sapling"] == 0.5 and result["success"]["place_plant"] == 0.0
    # Recomputed from the rates, not read back: 100 % and 50 %, 20 zeros: exp((ln 101 + ln 51) / 22) - 1.
    assert result["score"] == pytest.approx(0.4747633736126522, rel=1e-12)
    assert bench_learning.paper_crafter_score(path, budget=999) is None


def test_seeds_are_averaged_with_the_population_std() -> None:
    summary = bench_learning.mean_std([1.0, 2.0, 6.0])
    assert summary == {"mean": 3.0, "std": pytest.approx(math.sqrt(14 / 3)), "n": 3}


def test_success_table_lists_every_achievement_and_both_scores() -> None:
    rates = {name: 0.0 for name in CRAFTER_ACHIEVEMENTS} | {"collect_wood": 0.9}
    rows = [
        {"seed": s, "final_crafter_score": 1.5, "paper_crafter": {"score": 0.42, "episodes": 7, "success": rates}}
        for s in (0, 1)
    ]
    table = bench_learning.success_table(rows).splitlines()
    assert table[0].split() == ["achievement", "seed", "0", "seed", "1"]
    assert table[1].split() == ["collect_wood", "90.0%", "90.0%"]  # most often unlocked first
    assert len(table) == 1 + 22 + 3
    assert table[-3].split()[-2:] == ["0.42%", "0.42%"] and table[-2].split()[-1] == "1.50%"
