"""The driver's watchdogs: a run that cannot make progress fails, saying why, instead of waiting forever.

* ``ProgressWatchdog``: the driver's; no new env step or no new training iteration for
  ``progress_timeout`` seconds fails the run with ``stall_report``: the last error of every rollout
  worker and the replay buffer's account of why no chunk is eligible.
* The trainer's wait for chunks is bounded by the same ``progress_timeout`` (``TrainLoop._sample``).
* ``sigterm_as_ctrl_c``: SIGTERM (a preempted node, ``kill``, a scheduler's stop) takes Ctrl-C's
  path: the trainer finishes its iteration, writes a final checkpoint and the run stops cleanly; a
  second SIGTERM aborts, like a second Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from mineonline_core.errors import RunFailedError

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.manager import RolloutManager

# What the driver watches in the logging actor's latest metrics, and how a stall of each reads.
WATCHED = {"env_steps": "no new env step", "trainer/iteration": "no new training iteration"}


class ProgressWatchdog:
    """Fed the logging actor's latest metrics every second or so by the driver; ``stalled`` names
    what has not moved for ``timeout`` seconds (0 disables it). Both clocks start at creation, so a
    run that never steps an env or never finishes an iteration is caught too."""

    def __init__(self, *, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        now = clock()
        self._seen: dict[str, tuple[Any, float]] = {key: (None, now) for key in WATCHED}

    def stalled(self, latest: dict[str, Any]) -> str | None:
        now = self._clock()
        for key, what in WATCHED.items():
            value, since = self._seen[key]
            if latest.get(key) != value:
                self._seen[key] = (latest.get(key), now)
            elif self.timeout and now - since > self.timeout:
                last = "none yet" if value is None else f"last value {value:g}"
                return f"{what} for {now - since:.0f}s ({key}: {last}; progress_timeout={self.timeout:g})"
        return None


def stall_report(manager: ActorHandle[RolloutManager], what: str, *, timeout: float = 30.0) -> RunFailedError:
    """The error a stalled run fails with: ``what`` stalled, plus the rollout side's diagnosis."""
    import ray

    try:
        lines = ray.get(manager.diagnose.remote(), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a manager that cannot answer is part of the diagnosis
        lines = [f"the rollout manager did not answer ({type(exc).__name__}: {exc})"]
    body = "\n".join(f"  - {line}" for line in lines)
    return RunFailedError(
        f"The run made no progress: {what}, so it stops.\n{body}\nFix the cause above, or raise progress_timeout "
        f"if iterations are legitimately this slow (0 disables the watchdog)."
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def sigterm_as_ctrl_c() -> Callable[[], None]:
    """Make SIGTERM and SIGINT raise ``KeyboardInterrupt`` in the main thread; returns the function that
    restores the previous handlers. SIGINT is set too because a process can inherit it ignored: a
    non-interactive shell starts background jobs that way (CI scripts, ``cmd &``), and Python then installs
    no Ctrl-C handler, so ``kill -INT`` did nothing. Outside the main thread (a driver embedded in another
    program) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore
