"""Heartbeats: a rollout worker or trainer rank silent past ``hang_timeout`` is named and killed.

A frozen process (SIGSTOP, a stuck syscall, a debugger) answers nothing and raises nothing: without a
heartbeat the run only learns of it at ``progress_timeout`` (15 minutes by default), with the advice
for a slow rollout side. So every watched process reports its liveness, and a watcher that holds its
last report (``Heartbeats``) names the one silent past the bound, with its pid, node and that report,
on the console and in ``run.log``, then kills it by pid on its node (``kill_on_node``): a killed process
takes the path of a crashed one, which the run already survives.

* **Rollout workers**: the manager's monitor keeps one ``report()`` call in flight per worker; its answer
  is the heartbeat (``rollout/manager.py``). A killed worker is restarted by Ray (``max_restarts=-1``),
  registers again and counts against ``max_worker_restarts``, as a crashed worker does.
* **Trainer ranks** on Ray Train: a thread in each rank sends a beat every quarter of the bound to the
  run's ``HeartbeatBoard`` actor (``RankBeat``); a thread in the driver reads the board
  (``RankWatch``). A killed rank is a dead rank: ``DriverSide.fit`` restarts training from the latest
  checkpoint within ``max_trainer_restarts`` (``trainer/recovery.py``), or fails naming the hang.
  A rank in the driver's own process (one CPU rank) is not watched: when that process is frozen,
  nothing of the driver runs, and there is nothing left to restart it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

from mineonline_core.services.names import on_node

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


@dataclass
class Beat:
    """The last report of one watched process (one life of it)."""

    pid: int
    node: str
    at: float  # the watcher's clock at the report
    wall: float  # time.time() of the report, for the message
    detail: str = ""  # what it last reported (env steps, iteration)


class Heartbeats:
    """The last report of each member; ``silent`` lists those silent past ``timeout`` (0: never).
    Thread-safe: a member's new life may start while a monitor thread reads."""

    def __init__(self, *, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self._clock = timeout, clock
        self._beats: dict[Hashable, Beat] = {}
        self._lock = threading.Lock()

    def start(self, member: Hashable, *, pid: int, node: str, detail: str = "") -> None:
        """Watch a new life of ``member`` from now."""
        with self._lock:
            self._beats[member] = Beat(pid=pid, node=node, at=self._clock(), wall=time.time(), detail=detail)

    def beat(self, member: Hashable, detail: str | None = None) -> None:
        """``member`` answered: its silence starts again. Ignored for a member not watched."""
        with self._lock:
            beat = self._beats.get(member)
            if beat is not None:
                beat.at, beat.wall = self._clock(), time.time()
                beat.detail = beat.detail if detail is None else detail

    def forget(self, member: Hashable) -> Beat | None:
        """Stop watching ``member`` (killed: its next life calls ``start``); its last beat."""
        with self._lock:
            return self._beats.pop(member, None)

    def silent(self) -> list[tuple[Hashable, Beat, float]]:
        """``(member, last beat, seconds silent)`` of every member silent past ``timeout``."""
        if not self.timeout:
            return []
        with self._lock:
            now = self._clock()
            return [(m, b, now - b.at) for m, b in self._beats.items() if now - b.at > self.timeout]


def hung_message(what: str, beat: Beat, silent_for: float, timeout: float, action: str) -> str:
    """The line that names a hang: who, pid, node, how long, the last report, what is done about it."""
    when = time.strftime("%H:%M:%S", time.localtime(beat.wall))
    last = f"{beat.detail} at {when}" if beat.detail else f"at {when}"
    return (
        f"{what} is hung: pid {beat.pid} on node {beat.node[:12]} sent no liveness report for {silent_for:.0f}s "
        f"(hang_timeout={timeout:g}); its last report: {last}. {action}"
    )


def _kill_pid(pid: int) -> bool:
    import signal

    try:
        os.kill(pid, signal.SIGKILL)  # a stopped process is killed too
        return True
    except ProcessLookupError:
        return False


def kill_on_node(pid: int, node: str, *, timeout: float = 60.0) -> bool:
    """SIGKILL ``pid`` on Ray node ``node`` (a task pinned there); False when it was already gone."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_kill_pid)
    return bool(ray.get(task.options(scheduling_strategy=on_node(node)).remote(pid), timeout=timeout))


class HeartbeatBoard:
    """Ray actor (``num_cpus=0``): the ranks' beats, aged on its own clock (nodes' clocks may differ)."""

    def __init__(self) -> None:
        self._beats: dict[str, tuple[int, str, float, float, str]] = {}

    def beat(self, member: str, pid: int, node: str, detail: str) -> None:
        self._beats[member] = (pid, node, time.monotonic(), time.time(), detail)

    def read(self) -> dict[str, tuple[int, str, float, float, str]]:
        """Per member: ``(pid, node, seconds since its last beat, wall time of it, detail)``."""
        now = time.monotonic()
        return {m: (pid, node, now - at, wall, d) for m, (pid, node, at, wall, d) in self._beats.items()}

    def clear(self) -> None:
        """A new Ray Train attempt: the old ranks are gone."""
        self._beats.clear()


class RankBeat:
    """In a Ray Train rank: a daemon thread that beats every quarter of ``timeout`` with ``detail()``."""

    def __init__(
        self, *, board: ActorHandle[HeartbeatBoard], member: str, timeout: float, detail: Callable[[], str]
    ) -> None:
        import ray

        self._board, self._member, self._detail = board, member, detail
        self._pid, self._node = os.getpid(), ray.get_runtime_context().get_node_id()
        self._stop = threading.Event()
        self._interval = timeout / 4
        self._thread = threading.Thread(target=self._run, name="mineonline-rank-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._board.beat.remote(self._member, self._pid, self._node, self._detail())
            except Exception:  # noqa: BLE001 - a board gone at the run's end; the watcher sees the silence
                log.debug("heartbeat not sent", exc_info=True)
            if self._stop.wait(self._interval):
                return

    def stop(self) -> None:
        self._stop.set()


class RankWatch:
    """In the driver, while Ray Train runs: reads the board every quarter of ``timeout``; a rank silent
    past it is named (``log.error``) and killed on its node. ``hung`` holds the message of the last
    rank it killed (the cause ``fit`` reports), None when it killed none."""

    def __init__(self, *, board: ActorHandle[HeartbeatBoard], timeout: float) -> None:
        self._board, self.timeout = board, timeout
        self.hung: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mineonline-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        killed: set[tuple[str, int]] = set()
        while not self._stop.wait(self.timeout / 4):
            try:
                beats = ray.get(self._board.read.remote(), timeout=self.timeout)
            except Exception:  # noqa: BLE001 - the run is ending, or the board's node died
                log.warning("the trainer ranks' heartbeat board did not answer", exc_info=True)
                continue
            for member, (pid, node, silent_for, wall, detail) in sorted(beats.items()):
                if silent_for <= self.timeout or (member, pid) in killed:
                    continue
                beat = Beat(pid=pid, node=node, at=0.0, wall=wall, detail=detail)
                message = hung_message(
                    member, beat, silent_for, self.timeout, "Killing it: training restarts from the latest checkpoint."
                )
                log.error("%s", message)
                killed.add((member, pid))
                self.hung = message
                try:
                    kill_on_node(pid, node)
                except Exception:  # noqa: BLE001 - its node is gone: Ray Train sees the rank die anyway
                    log.warning("could not kill hung %s (pid %d)", member, pid, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout)
