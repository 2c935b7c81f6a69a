"""``WorkerSupervisor``: the lives of a run's rollout workers, as the ``RolloutManager`` sees them.

Ray restarts a killed or crashed worker (``max_restarts=-1``); each life registers with the manager, which
numbers it here (``register``: an incarnation per worker, so stream names stay unique across restarts) and
counts the restarts against ``rollout_config.max_worker_restarts`` per ``restart_window`` (``RestartBudget``):
a budget spent fails the run, naming each worker's state, instead of restarting forever. A worker's answer to
``report()`` is its heartbeat (``worker_reports``, called by the manager's monitor thread, one call per worker in
flight): one silent past ``hang_timeout`` is named (pid, node, last report) and killed, and Ray restarts it
(``kill_hung``, ``services/heartbeat.py``). The replay buffer is told which workers are hung or dead, so that a
trainer waiting for chunks says so (``ReplayBuffer.explain``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.services.heartbeat import Heartbeats, hung_message
from mineonline_core.services.restarts import RestartBudget

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.rollout.worker import RolloutWorker

log = logging.getLogger(__name__)


class WorkerSupervisor:
    """Runs in the manager's actor: ``register`` on the callers' threads, the rest on the monitor thread.
    ``fail(exc, what)`` fails the run (the manager's ``health()`` raises it)."""

    def __init__(
        self,
        *,
        workers: list[ActorHandle[RolloutWorker]],
        buffer: ActorHandle[ReplayBuffer],
        config: Any,
        fail: Callable[[BaseException, str], None],
    ) -> None:
        rollout_config = config.rollout_config
        self.config, self._workers, self._buffer, self._fail = config, workers, buffer, fail
        self._lock = threading.Lock()
        self.incarnations: dict[int, int] = {}  # restarts in this run, per worker
        self._restarts = RestartBudget(cap=rollout_config.max_worker_restarts, window=rollout_config.restart_window)
        self._last_errors: dict[int, str] = {}  # worker id -> the last failure the monitor saw
        self._beats = Heartbeats(timeout=config.hang_timeout)  # the workers' lives, by worker id
        self._reporting: dict[int, tuple[Any, int]] = {}  # worker id -> its report() call in flight, the life asked
        self._missing: dict[int, str] = {}  # worker id -> why no fragment comes from it now (hung, dead)
        self.hangs = 0

    def register(self, worker_id: int, *, pid: int, node: str) -> int:
        """A worker life registered: its number of restarts in this run (0 for the first life)."""
        with self._lock:
            restarts = self.incarnations.get(worker_id, -1) + 1
            self.incarnations[worker_id] = restarts
            over = bool(restarts) and self._restarts.add()
        self._beats.start(worker_id, pid=pid, node=node, detail=f"life {restarts} registered")
        self._set_missing(worker_id, None)
        if restarts:
            log.warning("rollout worker %d restarted (life %d); sending it the latest weights", worker_id, restarts)
        if over:
            rollout_config = self.config.rollout_config
            self._fail(
                RunFailedError(
                    f"rollout workers were restarted {self._restarts.count()} times within "
                    f"{self._restarts.span():.0f}s "
                    f"(rollout_config.max_worker_restarts={rollout_config.max_worker_restarts} per restart_window="
                    f"{rollout_config.restart_window:g}s), so the run stops instead of restarting them forever.\n"
                    + "\n".join(f"  - {line}" for line in self.worker_lines())
                    + "\nFix the cause above (a worker that dies at every start), or raise max_worker_restarts."
                ),
                "too many rollout worker restarts",
            )
        return restarts

    def worker_reports(self, wait: float = 30.0) -> list[tuple[int, dict[str, float]]]:
        """The reports answered within ``wait`` seconds. One call per worker is in flight at a time, so
        a frozen worker delays no other's report; its silence is timed by ``_beats``."""
        import ray

        for i, worker in enumerate(self._workers):
            if i not in self._reporting:
                self._reporting[i] = (worker.report.remote(), self.incarnations.get(i, -1))
        refs = [ref for ref, _ in self._reporting.values()]
        ray.wait(refs, num_returns=len(refs), timeout=wait)
        reports = []
        for i, (ref, life) in list(self._reporting.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._reporting[i]
            try:
                report = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._last_errors[i] = last_line(exc, limit=300)
                if life == self.incarnations.get(i, -1):  # not a life that registered since the call
                    self._beats.forget(i)  # being restarted by Ray; it re-registers and gets the latest weights
                    self._set_missing(i, f"rollout worker {i} died and is being restarted ({self._last_errors[i]})")
                continue
            except Exception as exc:  # noqa: BLE001 - a worker's background thread failed
                self._fail(exc, f"rollout worker {i} failed")
                continue
            reports.append((i, report))
            self._beats.beat(i, f"{int(report.get('rollout/fragments_sent', 0))} fragments sent")
        return reports

    def kill_hung(self) -> None:
        """Name and kill every worker silent past ``hang_timeout``: Ray restarts it like a crashed one."""
        import ray

        for i, beat, silent_for in self._beats.silent():
            life = self.incarnations.get(i, 0)
            message = hung_message(
                f"rollout worker {i} (life {life})",
                beat,
                silent_for,
                self._beats.timeout,
                "Killing it; Ray restarts it like a crashed worker.",
            )
            log.error("%s", message)
            self._beats.forget(i)
            self.hangs += 1
            self._last_errors[i] = message
            self._set_missing(i, message)
            ray.kill(self._workers[i], no_restart=False)

    def _set_missing(self, worker_id: int, why: str | None) -> None:
        """Record why no fragment comes from a worker (None: it is back) and tell the buffer."""
        with self._lock:  # the monitor thread and register_worker's callers
            if self._missing.get(worker_id) == why:
                return
            if why is None:
                self._missing.pop(worker_id)
            else:
                self._missing[worker_id] = why
            self._buffer.set_missing_workers.remote(sorted(self._missing.values()))

    def worker_lines(self) -> list[str]:
        """One line per worker: its life, env steps, fragments sent and last error (or why it does not answer)."""
        import ray

        lines = []
        for i, worker in enumerate(self._workers):
            try:
                s = ray.get(worker.status.remote(), timeout=5)
                state = (
                    f"life {s['incarnation']}, {s['env_steps']} env steps, {s['fragments_sent']} fragments sent, "
                    f"ready={s['ready']}"
                )
                error = s["error"] or self._last_errors.get(i)
            except Exception as exc:  # noqa: BLE001 - dead or restarting: say so
                state, error = (
                    f"not answering ({type(exc).__name__})",
                    self._last_errors.get(i) or last_line(exc, limit=300),
                )
            lines.append(f"rollout worker {i}: {state}; last error: {error or 'none'}")
        return lines
