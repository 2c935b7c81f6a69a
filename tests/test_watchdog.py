"""The watchdogs' counting on a fake clock: restarts over a sliding window, and progress that stalls."""

from __future__ import annotations

import os
import signal

import pytest

from mineonline_core.driver.watchdog import ProgressWatchdog, sigterm_as_ctrl_c
from mineonline_core.services.restarts import RestartBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_restart_budget_counts_over_a_sliding_window() -> None:
    clock = Clock()
    budget = RestartBudget(cap=2, window=10.0, clock=clock)
    assert not budget.add() and not budget.add()  # two restarts at t=0: at the cap, not over it
    clock.now = 11.0
    assert not budget.add() and budget.count() == 1  # the old ones left the window
    clock.now = 12.0
    assert not budget.add()
    clock.now = 13.0
    assert budget.add() and budget.count() == 3 and budget.span() == 2.0


def test_progress_watchdog_names_what_stalled() -> None:
    clock = Clock()
    dog = ProgressWatchdog(timeout=5.0, clock=clock)
    for t in range(1, 5):
        clock.now = float(t)
        assert dog.stalled({"env_steps": 100.0 * t, "trainer/iteration": float(t)}) is None
    clock.now = 9.5  # env steps went on, iterations stopped at 4 (t=4): 5.5 s
    stalled = dog.stalled({"env_steps": 950.0, "trainer/iteration": 4.0})
    assert stalled.startswith("no new training iteration for 6s") and "last value 4" in stalled
    clock.now = 15.0
    never = ProgressWatchdog(timeout=5.0, clock=clock)
    clock.now = 16.0
    assert never.stalled({"env_steps": 0.0}) is None  # the first sight of env steps counts as progress
    clock.now = 22.0
    assert never.stalled({"env_steps": 0.0}).startswith("no new env step for 6s (env_steps: last value 0")
    off = ProgressWatchdog(timeout=0.0, clock=clock)
    clock.now = 1e6
    assert off.stalled({}) is None


def test_sigterm_raises_keyboard_interrupt_like_ctrl_c() -> None:
    restore = sigterm_as_ctrl_c()
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0.5)  # the handler runs at the next bytecode boundary
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
