"""The fault injector itself: deterministic, counted, picklable, and never kills the test runner."""

from __future__ import annotations

import pickle

import gymnasium as gym
import pytest

from mineonline_core.testing import kit as tk
from mineonline_core.testing.faults import FaultyEnvFactory, InjectedFault, injected_faults


def counting() -> gym.Env:
    return tk.CountingEnv(tag=1.0, episode_len=1000)


def _fault_steps(env: gym.Env, n: int) -> list[int]:
    env.reset(seed=0)
    steps = []
    for _ in range(n):
        try:
            env.step(0)
        except InjectedFault:
            steps.append(env.steps)
    return steps


def test_rate_faults_are_deterministic_per_seed_and_life(tmp_path) -> None:
    def make(d, seed):
        return FaultyEnvFactory(counting, step_error_rate=0.1, seed=seed, state_dir=str(tmp_path / d))

    a0, a1 = _fault_steps(make("a", 3)(), 300), _fault_steps(make("a", 3)(), 300)
    b0 = _fault_steps(make("b", 3)(), 300)
    c0 = _fault_steps(make("c", 4)(), 300)
    assert a0 == b0  # same seed, same life: the same faults
    assert a0 != a1 and a0 != c0  # a new life or another seed: another sequence
    assert 10 <= len(a0) <= 60  # about 10% of 300
    counts = injected_faults(tmp_path / "a")
    assert counts["step_error"] == len(a0) + len(a1) and counts["lives"] == 2


def test_scheduled_faults_fire_once_across_lives(tmp_path) -> None:
    factory = FaultyEnvFactory(counting, raise_at_step=5, kill_at_step=9, once=True, state_dir=str(tmp_path))
    first = factory()
    assert _fault_steps(first, 8) == [5]
    with pytest.raises(InjectedFault, match="guarded process"):  # kill in the test runner: refused
        first.step(0)
        first.step(0)
    assert _fault_steps(factory(), 20) == []  # the second life runs clean
    assert injected_faults(tmp_path) == {
        "step_error": 1,
        "reset_error": 0,
        "hang": 0,
        "kill": 1,
        "nan_reward": 0,
        "nan_obs": 0,
        "lives": 2,
    }


def test_reset_faults_and_pickling(tmp_path) -> None:
    factory = pickle.loads(pickle.dumps(FaultyEnvFactory(counting, reset_error_rate=1.0, state_dir=str(tmp_path))))
    with pytest.raises(InjectedFault, match="reset"):
        factory().reset()
    assert injected_faults(tmp_path)["reset_error"] == 1
    with pytest.raises(ValueError, match="step_error_rate"):
        FaultyEnvFactory(counting, step_error_rate=2.0)()


def test_live_records_leave_out_the_line_being_written(tmp_path) -> None:
    import json

    from mineonline_core.testing.faults import live_records

    assert live_records(tmp_path) == []  # the run has not written its first record yet
    whole = [{"step": 0, "trainer/iteration": 1.0}, {"step": 16, "episode/count": 2.0}]
    text = "".join(json.dumps(r) + "\n" for r in whole)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 32, "trainer/pol')  # as a fault test read it mid-write
    assert live_records(tmp_path) == whole
