"""Restarts counted over a sliding window (RLlib's ``max_num_env_runner_restarts``, per time window).

The rollout manager holds one ``RestartBudget`` for worker restarts (``rollout_config.max_worker_restarts``),
each env pool one for env rebuilds (``worker_config.max_env_rebuilds``), both over
``rollout_config.restart_window``; a budget spent fails the run instead of restarting forever.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class RestartBudget:
    """At most ``cap`` events within any ``window`` seconds; ``add`` says whether this one is over."""

    def __init__(self, *, cap: int, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap, self.window, self._clock = cap, window, clock
        self._times: deque[float] = deque()

    def add(self) -> bool:
        """Record one event; True when the window now holds more than ``cap`` events."""
        now = self._clock()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times) > self.cap

    def count(self) -> int:
        return len(self._times)

    def span(self) -> float:
        """Seconds between the oldest and the newest event in the window."""
        return self._times[-1] - self._times[0] if self._times else 0.0
