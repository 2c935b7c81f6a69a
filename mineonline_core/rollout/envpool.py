"""``EnvPool``: a rollout worker's envs, each in its own process, started, supervised and rebuilt.

The pool runs ``len(env_fns)`` envs, each in a subprocess (``EnvProcess``) or, with
``worker_config.env_processes: false``, in the caller's thread (``InlineEnv``; ``envproc.py``), and steps them
asynchronously. Its caller (the ``FragmentCollector``) asks it for the observations awaiting an action (``take``),
hands the actions back (``send_action``) and, while too few observations are ready, waits (``wait``): for an env
to answer, for a hang deadline or for the next scheduled rebuild. What the envs said comes back as ``Answer``
records, which the caller turns into trajectories. The pool knows nothing of policies, recurrent states or
fragments, so whatever chooses the actions (a local forward, an inference server) sits on the caller's side.

``take`` never lets a slow env stall the others: a busy env is waited for only while it is punctual (``LATE_FACTOR``
times the mean step time); once it is late, the envs that have an observation go on as a partial batch, even
when ``batch_size`` is ``num_envs``, and the late one joins a later batch when it answers or is rebuilt at
``step_timeout``.

What goes wrong, the env's side (an env that fails is rebuilt, its episode closed as truncated; the caller
closes the step in flight):

* the env raised, hung past ``step_timeout`` or its process died: the answer is ``lost``, the process is killed
  and rebuilt after an exponential back-off, and the other envs go on. When the step itself succeeded and ended
  the episode and only the automatic reset after it failed, the step is answered as it happened first.
* the env answered a NaN or infinite reward or observation (``mineonline_core.services.finite``): ``lost`` too,
  but the env is reset instead of rebuilt; the bad values never leave the pool.
* a process older than ``restart_interval`` is recycled after its next step, which is answered as truncated.

An env failing ``max_env_restarts`` times in a row, more than ``max_env_rebuilds`` rebuilds within
``restart_window`` (``RestartBudget``), an env that never started raising the same exception ``STARTUP_ATTEMPTS``
times, or an env factory that its process cannot load, stops the worker with a ``RunFailedError`` naming the cause.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection
from typing import Any, Callable

from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.rollout.envproc import EnvFailure, EnvProcess, InlineEnv, default_context
from mineonline_core.rollout.fragbuild import Timers
from mineonline_core.services.finite import env_answer_problem
from mineonline_core.services.restarts import RestartBudget

log = logging.getLogger(__name__)

# A busy env holds a batch for at most LATE_FACTOR times the mean step time (never less than
# LATE_FLOOR_S: a fast env's jitter must not split every batch); then the ready envs go on without it.
LATE_FACTOR = 10.0
LATE_FLOOR_S = 0.2
# Starts of a never-started env that may fail with the same exception before the worker gives up.
STARTUP_ATTEMPTS = 3


@dataclass(frozen=True)
class Answer:
    """What env ``env_id`` said. ``kind`` is "reset" (a fresh or reset env is ready; ``info`` is its reset's),
    "step" (the answer to its action; ``obs`` is the next observation, None when the reset after an episode end
    failed; ``truncated`` includes a recycling at ``restart_interval``) or "lost" (the env failed: the step in
    flight, if any, is gone)."""

    env_id: int
    kind: str
    obs: Any = None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)
    final_obs: Any = None


class _Slot:
    """Everything the pool tracks for one env: its process and the command in flight."""

    def __init__(self, env_id: int) -> None:
        self.env_id = env_id
        self.proc: EnvProcess | InlineEnv | None = None
        self.obs: Any = None  # the observation awaiting an action; None while busy or down
        self.stepping = False  # is the command in flight a step (not a reset)?
        self.sent_at = 0.0
        self.deadline = 0.0
        self.started_at = 0.0
        self.restart_at: float | None = 0.0  # when down: the time to rebuild
        self.failures_in_row = 0
        self.started = False  # has this env ever answered its first reset?
        self.startup_error: str | None = None  # the exception that stopped its last start
        self.same_startup_errors = 0
        self.builds = 0


class EnvPool:
    """The envs of one rollout worker. Not thread-safe: one thread steps it."""

    def __init__(
        self,
        *,
        env_fns: list[Callable[[], Any]],
        config: RolloutConfig,
        worker_id: int = 0,
        seed: int | None = None,
        startup_timeout: float | None = None,
        backoff_base: float = 0.1,
        backoff_max: float = 10.0,
    ) -> None:
        """``config`` is the run's ``rollout_config`` (its ``worker_config`` and ``restart_window``); the envs
        start at once."""
        wc = config.worker_config
        self.env_processes = wc.env_processes
        self.env_fns = list(env_fns)
        self.step_timeout, self.max_env_restarts = wc.step_timeout, wc.max_env_restarts
        self._rebuilds = RestartBudget(cap=wc.max_env_rebuilds, window=config.restart_window)
        self._last_failure = ""
        # Building a simulator (Minecraft) can take far longer than a step: its own, longer limit.
        self.startup_timeout = startup_timeout if startup_timeout is not None else max(wc.step_timeout, 120.0)
        self.worker_id, self.restart_interval, self.seed = worker_id, wc.restart_interval, seed
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self._ctx = default_context()
        self._slots = [_Slot(i) for i in range(len(env_fns))]
        self._ready: deque[int] = deque()
        self._answers: list[Answer] = []
        self._step_mean: float | None = None  # moving mean of the envs' step round trips, in seconds
        self.timers = Timers()
        self.env_restarts = self.env_failures = self.env_nonfinite = 0
        for slot in self._slots:
            self._start_env(slot, time.monotonic())

    # -- public API ---------------------------------------------------------------------------

    def take(self, n: int) -> list[tuple[int, Any]] | None:
        """Up to ``n`` ``(env_id, observation)`` pairs awaiting an action, or None while they are worth
        waiting for. A busy env is waited for only while it is punctual (``_late_after``): once it is late,
        the envs that have an observation go on as a partial batch. Rebuilds whose back-off is over start here."""
        now = self._restart_due()
        punctual = self._punctual(self._busy(), now)
        want = min(n, len(punctual) + len(self._ready))  # rebuilt or late envs are not waited for
        if not want or len(self._ready) < want:
            return None
        ids = [self._ready.popleft() for _ in range(want)]
        return [(i, self._slots[i].obs) for i in ids]

    def idle(self) -> bool:
        """True when no env is working on a command (a ``wait`` would only wait for rebuilds)."""
        return not self._busy()

    def wait(self) -> list[Answer]:
        """Wait until an env answers, a hang deadline or the next scheduled rebuild (at most a second, or until
        the first punctual env turns late while observations are ready); returns what happened."""
        now = time.monotonic()
        punctual = self._punctual(self._busy(), now)
        self._poll(max_wait=min([1.0, *(t - now for t in punctual)]) if self._ready else 1.0)
        return self._drain()

    def send_action(self, env_id: int, action: Any) -> list[Answer]:
        """Send env ``env_id`` (one ``take`` handed out) its action; returns a ``lost`` answer when it is gone."""
        slot = self._slots[env_id]
        slot.obs, slot.stepping = None, True
        self._send(slot, functools.partial(slot.proc.send_step, action), self.step_timeout)
        return self._drain()

    def warmup(self, timeout: float) -> list[Answer]:
        """Wait until every env has been built and reset (failed ones are rebuilt meanwhile)."""
        end = time.monotonic() + timeout
        while not all(s.obs is not None for s in self._slots):
            if time.monotonic() >= end:
                down = [s for s in self._slots if s.obs is None]
                causes = "".join(f"\n  env {s.env_id}: last failure {s.startup_error}" for s in down if s.startup_error)
                raise TimeoutError(
                    f"worker {self.worker_id}: envs {[s.env_id for s in down]} not ready after {timeout:.0f}s{causes}"
                )
            self._poll(max_wait=0.5)
        return self._drain()

    def pids(self) -> list[int | None]:
        """Each env's process id (None for an env down or run inline)."""
        return [getattr(s.proc, "pid", None) for s in self._slots]

    def metrics(self) -> dict[str, float]:
        """Counters (cumulative) and ``perf/env_step_ms`` since the previous call."""
        return {
            "rollout/env_restarts": float(self.env_restarts),
            "rollout/env_failures": float(self.env_failures),
            "rollout/env_nonfinite": float(self.env_nonfinite),
            **self.timers.drain(),
        }

    def close(self) -> None:
        for slot in self._slots:
            if slot.proc is not None:
                slot.proc.close(timeout=2.0)
                slot.proc = None

    # -- env lifecycle ------------------------------------------------------------------------

    def _start_env(self, slot: _Slot, now: float) -> None:
        seed = None if self.seed is None else self.seed + 1000 * self.worker_id + slot.env_id + 7919 * slot.builds
        if slot.builds:
            self.env_restarts += 1
            if slot.failures_in_row and self._rebuilds.add():  # restart_interval recycling is not a failure
                self.close()
                raise RunFailedError(
                    f"Rollout worker {self.worker_id}: its envs were rebuilt {self._rebuilds.count()} times within "
                    f"{self._rebuilds.span():.0f}s (rollout_config.worker_config.max_env_rebuilds="
                    f"{self._rebuilds.cap} per rollout_config.restart_window={self._rebuilds.window:g}s). "
                    f"Last failure: {self._last_failure}\n"
                    f"Fix the env, or raise max_env_rebuilds if failures are expected."
                )
        slot.builds += 1
        env_fn = self.env_fns[slot.env_id]
        slot.proc = EnvProcess(env_fn, ctx=self._ctx) if self.env_processes else InlineEnv(env_fn)
        slot.proc.send_reset(seed)
        slot.started_at = slot.sent_at = now
        slot.deadline = now + self.startup_timeout
        slot.restart_at = None
        slot.obs, slot.stepping = None, False

    def _on_failure(self, slot: _Slot, exc: EnvFailure) -> None:
        if not slot.started and exc.kind == "error":
            self._check_startup(slot, exc)
        if exc.kind == "fatal":
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: the env factory for env {slot.env_id} cannot be loaded in its "
                f"env process:\n{exc.detail}\nEnv factories are pickled into a fresh process: define "
                f"env_generator in an importable module (or a Python config file), not in a test or notebook cell "
                f"that the env process cannot import."
            )
        now = time.monotonic()
        log.warning("worker %d env %d failed (%s); rebuilding. %s", self.worker_id, slot.env_id, exc.kind, exc.detail)
        self._fail_step(slot, exc.detail)
        slot.proc.kill()
        slot.proc, slot.obs = None, None
        delay = min(self.backoff_base * 2 ** (slot.failures_in_row - 1), self.backoff_max)
        slot.restart_at = now + delay

    def _on_nonfinite(self, slot: _Slot, problem: str) -> None:
        """A NaN or infinity in the env's answer: the step failed, but the env process is sound, so
        it is reset rather than rebuilt. The bad values never leave the pool."""
        self.env_nonfinite += 1
        log.warning(
            "worker %d env %d: %s; the step counts as failed, its episode is closed as truncated and the env is reset",
            self.worker_id,
            slot.env_id,
            problem,
        )
        self._fail_step(slot, problem)
        slot.obs = None
        self._send(slot, functools.partial(slot.proc.send_reset, None), self.startup_timeout)

    def _send(self, slot: _Slot, send: Callable[[], None], timeout: float) -> None:
        """Send one command to the env with its deadline armed; a broken pipe is a failed env."""
        slot.sent_at = time.monotonic()
        slot.deadline = slot.sent_at + timeout
        try:
            send()
        except EnvFailure as exc:
            self._on_failure(slot, exc)

    def _fail_step(self, slot: _Slot, detail: str) -> None:
        """Count a failure and answer the env as ``lost`` (the caller closes its step in flight, if any)."""
        self.env_failures += 1
        slot.failures_in_row += 1
        self._last_failure = f"env {slot.env_id}: {detail}"
        slot.stepping = False
        self._answers.append(Answer(slot.env_id, "lost"))
        if slot.failures_in_row > self.max_env_restarts:
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: env {slot.env_id} failed {slot.failures_in_row} times in a "
                f"row (rollout_config.worker_config.max_env_restarts={self.max_env_restarts}). Last failure: "
                f"{detail}\nFix the env, or raise max_env_restarts if failures are expected."
            )

    def _check_startup(self, slot: _Slot, exc: EnvFailure) -> None:
        """An env that never started and raises the same exception ``STARTUP_ATTEMPTS`` times in a row
        will not start: stop with its own error now, not at the warm-up timeout minutes later."""

        error = last_line(exc.detail)
        slot.same_startup_errors = slot.same_startup_errors + 1 if error == slot.startup_error else 1
        slot.startup_error = error
        if slot.same_startup_errors >= STARTUP_ATTEMPTS:
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: env {slot.env_id} raised {error} while being built or reset, "
                f"{STARTUP_ATTEMPTS} times in a row, and never started; every env of this worker would fail the "
                f"same way. Fix the env (`mineonline check CONFIG` builds, resets and steps it once).\n{exc.detail}"
            )

    # -- waiting for answers ------------------------------------------------------------------

    def _busy(self) -> list[_Slot]:
        return [s for s in self._slots if s.proc is not None and s.obs is None]

    def _punctual(self, busy: list[_Slot], now: float) -> list[float]:
        """When each busy env that is not late yet turns late."""
        late_after = self._late_after()
        return [s.sent_at + late_after for s in busy if s.sent_at + late_after > now]

    def _late_after(self) -> float:
        """Seconds after which a busy env no longer holds a batch: ``LATE_FACTOR`` times the mean step
        time (``step_timeout`` until a step was measured), at least ``LATE_FLOOR_S``."""
        if self._step_mean is None:
            return self.step_timeout
        return min(max(LATE_FACTOR * self._step_mean, LATE_FLOOR_S), self.step_timeout)

    def _restart_due(self) -> float:
        now = time.monotonic()
        for slot in self._slots:
            if slot.proc is None and slot.restart_at is not None and slot.restart_at <= now:
                self._start_env(slot, now)
        return now

    def _poll(self, max_wait: float) -> None:
        """Rebuild envs whose back-off is over, then wait until an env answers, a hang deadline or
        the next scheduled rebuild (at most ``max_wait``), and handle what happened."""
        now = self._restart_due()
        busy = self._busy()
        wake = [s.deadline for s in busy] + [s.restart_at for s in self._slots if s.restart_at is not None]
        timeout = min(max(0.0, min(wake, default=now + max_wait) - now), max_wait)
        if not busy:
            time.sleep(timeout)
            return
        if not self.env_processes:  # inline envs answered already, inside send_step
            for slot in busy:
                self._receive(slot)
            return
        by_conn = {id(s.proc.conn): s for s in busy}
        for conn in connection.wait([s.proc.conn for s in busy], timeout):
            self._receive(by_conn[id(conn)])
        now = time.monotonic()
        for slot in busy:
            if slot.proc is not None and slot.obs is None and slot.deadline <= now:
                self._on_failure(slot, EnvFailure("timeout", f"no answer within {now - slot.sent_at:.1f}s"))

    def _receive(self, slot: _Slot) -> None:
        try:
            obs, reward, terminated, truncated, info, final_obs = slot.proc.recv()
        except EnvFailure as exc:
            if exc.step is not None and slot.stepping:
                # Only the reset after an episode end failed: the step itself stands as it happened.
                reward, terminated, truncated, info, final_obs = exc.step
                self._stepped(slot, reward, terminated, truncated and not terminated, info, final_obs, None)
            self._on_failure(slot, exc)
            return
        problem = env_answer_problem(reward, obs, final_obs)
        if problem is not None:
            self._on_nonfinite(slot, problem)
            return
        now = time.monotonic()
        if not slot.stepping:  # the answer to a fresh process's reset
            slot.started = True
            slot.obs = obs
            self._ready.append(slot.env_id)
            self._answers.append(Answer(slot.env_id, "reset", info=info))
            return
        slot.failures_in_row = 0
        took = now - slot.sent_at  # a step's round trip: what a punctual env takes (``_late_after``)
        self._step_mean = took if self._step_mean is None else 0.9 * self._step_mean + 0.1 * took
        recycle = self.restart_interval > 0 and now - slot.started_at >= self.restart_interval
        trunc = (truncated or recycle) and not terminated
        self._stepped(slot, reward, terminated, trunc, info, final_obs, obs)
        if recycle:
            slot.proc.close(timeout=5.0)
            self._start_env(slot, now)
            return
        slot.obs = obs
        self._ready.append(slot.env_id)

    def _stepped(
        self, slot: _Slot, reward: float, terminated: bool, trunc: bool, info: dict, final_obs: Any, obs: Any
    ) -> None:
        self.timers.add("perf/env_step_ms", (time.monotonic() - slot.sent_at) * 1e3)
        slot.stepping = False
        self._answers.append(Answer(slot.env_id, "step", obs, reward, terminated, trunc, info, final_obs))

    def _drain(self) -> list[Answer]:
        answers, self._answers = self._answers, []
        return answers
