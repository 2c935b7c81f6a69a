"""The run's logging actor: one place where every metric, histogram and video of a run arrives.

Producers (rollout workers, the replay buffer, episode statistics, the trainer's rank 0) call the hub
fire-and-forget (``hub.log_metrics.remote(...)`` without ``ray.get``), so logging never sits on a hot
path. Each call only records the latest values and enqueues the item; one background thread feeds the
loggers in arrival order. A logger that raises is logged with its traceback and disabled, alone: the
other loggers and every producer carry on, and ``logger/errors`` in ``latest()`` and the summary says
how many loggers failed.

The hub owns the run's single step axis: the total number of env steps, advanced by rollout workers
through ``add_env_steps``. A metric logged without an explicit step is stamped with the current count.

Ray restarts the hub when its process dies (``ACTOR_OPTIONS``: same name, so every producer's handle
still reaches it; calls in flight are retried; at most ``MAX_ACTOR_RESTARTS`` times). The restarted hub
starts its loggers again (``metrics.jsonl`` is appended to), takes the step axis up where the dead one
left it (the count is kept in Ray's key-value store at every record stamped, so no record is stamped
with a smaller step than one before it), says so on the console and in ``run.log`` and counts it in
``logging/restarts``. Records the dead hub had queued but not yet written are lost with it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from pydantic import BaseModel

from mineonline_core.errors import last_line
from mineonline_core.contracts.logger import Logger
from mineonline_core.services.names import LOGGER_HUB, NAMESPACE, actor_name
from mineonline_core.services.restarts import MAX_ACTOR_RESTARTS, actor_restart, current_actor_name, recall, remember
from mineonline_core.services.runlog import setup_actor_logging

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

_STOP = object()

# Producer calls (log_*, add_env_steps) and flush/finish run on the actor's default single thread,
# so the calls of one producer reach the loggers in the order they were made (Ray keeps a caller's
# order on a single-threaded group) and a caller's flush/finish comes after its earlier calls.
# Queries (latest, env_steps, errors) have a group of their own and never wait behind a flush.
CONTROL = "control"
CONCURRENCY_GROUPS = {CONTROL: 4}
#: ``ray.remote(**ACTOR_OPTIONS)(LoggerHub)`` is the hub actor class (``start_logger_hub`` uses it).
ACTOR_OPTIONS = {
    "num_cpus": 0,
    "max_concurrency": 1,
    "concurrency_groups": CONCURRENCY_GROUPS,
    "max_restarts": MAX_ACTOR_RESTARTS,
    "max_task_retries": -1,
}
#: How many times Ray restarted the run's logging actor (logged by the restarted hub itself).
RESTARTS_METRIC = "logging/restarts"


def video_filename(key: str, step: int) -> str:
    """The file a video logged under ``key`` at ``step`` is written to (inside the video dir)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key.replace("/", "_"))
    return f"{safe}_step{step:09d}.mp4"


#: The run's env-step count as a metric: its value is always the step its record is stamped with.
ENV_STEPS = "rollout/env_steps"


class LoggerHub:
    """Receives metrics from every process of a run and feeds the selected loggers.

    Plain class: ``start_logger_hub`` makes it a named Ray actor with ``num_cpus=0`` and two
    concurrency groups (see ``CONCURRENCY_GROUPS``); tests may use it directly. ``loggers`` are (class,
    validated options) pairs; ``config`` is the full resolved run config given to each logger; ``video_dir`` is where
    videos are written, relative to ``run_dir`` unless absolute.
    """

    def __init__(
        self,
        *,
        run_dir: str,
        loggers: list[tuple[type[Logger], BaseModel]],
        config: dict,
        num_iterations: int,
        video_dir: str,
    ) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        self.run_dir = os.path.abspath(run_dir)
        self.video_dir = video_dir if os.path.isabs(video_dir) else os.path.join(self.run_dir, video_dir)
        self.num_iterations = num_iterations
        os.makedirs(self.run_dir, exist_ok=True)
        self._lock = threading.Lock()
        self._env_steps = 0
        self._latest: dict[str, float] = {}
        self._errors: list[str] = []  # "logger_name: Exception text", for the summary and the driver
        self._dropped: set[str] = set()
        self._finished = False
        self._summary: dict[str, float] | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loggers: list[Logger] = []
        restart = actor_restart(LOGGER_HUB)
        # A restarted hub's loggers continue the run's own records (the wandb run it kept the id of), as
        # for a run resumed from a checkpoint, instead of opening a second run beside the first.
        self._start_loggers(loggers, restarted_config(config, self.run_dir) if restart is not None else config)
        self._thread = threading.Thread(target=self._feed, name="logger-hub-feeder", daemon=True)
        self._thread.start()
        self._name = current_actor_name()  # where the step count is kept for a restart (None: a plain object)
        if restart is not None:
            count, name = restart
            self._env_steps = recall(name) or 0
            log.warning(
                "the logging actor %s died; Ray restarted it (restart %d, %s): its loggers started again, the step "
                "axis goes on from %d env steps; what it had queued and not yet written is lost",
                name,
                count,
                RESTARTS_METRIC,
                self._env_steps,
            )
            self.log_metrics({RESTARTS_METRIC: float(count)})

    def _start_loggers(self, loggers: list[tuple[type[Logger], BaseModel]], config: dict) -> None:
        for cls, options in loggers:
            try:
                self._loggers.append(cls(run_dir=self.run_dir, options=options, config=config))
            except Exception:  # noqa: BLE001 - a broken logger must not take the run down
                self._record_failure(getattr(cls, "name", cls.__name__), "start", traceback.format_exc())

    # ----- producer side: every call records and enqueues, nothing waits on a logger ----------

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> int | None:
        """Record scalars; ``step`` defaults to the current total env steps. Returns the step recorded
        (None after ``finish``): a producer that needs its record's step asks for it here, because a
        count read before the call can be overtaken by another producer's record."""
        clean: dict[str, float] = {}
        for key, value in metrics.items():
            try:
                clean[key] = float(value)
            except (TypeError, ValueError):
                if key not in self._dropped:  # warn once per key, not once per iteration
                    self._dropped.add(key)
                    log.warning(
                        "LoggerHub: metric %r has non-numeric value %r of type %s; it is dropped",
                        key,
                        value,
                        type(value).__name__,
                    )
        with self._lock:
            if self._finished:
                return None
            if step is None and ENV_STEPS in clean:
                # The producer read the count before this call; workers may have added steps since. A record
                # shows the count it is stamped with (a rollout report read 194 and was stamped at 280).
                clean[ENV_STEPS] = float(self._env_steps)
            step = self._env_steps if step is None else int(step)
            self._latest.update(clean)
            # enqueue under the lock so nothing lands behind finish()'s stop marker
            self._queue.put(("metrics", clean, step))
            if self._name is not None:  # a restarted hub must never stamp a smaller step than this one
                remember(self._name, max(step, self._env_steps))
            return step

    def log_histogram(self, key: str, values: np.ndarray, step: int | None = None) -> None:
        """Record a distribution (advantages, values, staleness)."""
        values = np.asarray(values).reshape(-1)
        with self._lock:
            if self._finished:
                return
            step = self._env_steps if step is None else int(step)
            self._queue.put(("histogram", key, values, step))

    def log_video(self, key: str, mp4: bytes, step: int | None = None, filename: str | None = None) -> None:
        """Write an mp4 under the video dir, then hand its path to every logger."""
        with self._lock:
            if self._finished:
                return
            step = self._env_steps if step is None else int(step)
            self._queue.put(("video", key, mp4, step, filename))

    def log_batch(
        self,
        metrics: dict[str, float] | None = None,
        histograms: dict[str, np.ndarray] | None = None,
        step: int | None = None,
    ) -> int:
        """An iteration's scalars and histograms in one call, all at one step, which it returns.

        Same effect as ``log_metrics`` plus one ``log_histogram`` per entry, in one actor task
        instead of 1 + len(histograms): Ray's per-task cost dominates what logging costs.
        """
        with self._lock:
            step = self._env_steps if step is None else int(step)
        if metrics:
            self.log_metrics(metrics, step)
        for key, values in (histograms or {}).items():
            self.log_histogram(key, values, step)
        return step

    def add_env_steps(self, n: int) -> None:
        with self._lock:
            self._env_steps += int(n)

    def set_env_steps(self, n: int) -> None:
        """Restore the step axis from a checkpoint when a run resumes; loggers hear of it (``Logger.resume``)."""
        with self._lock:
            self._env_steps = int(n)
            if not self._finished:
                self._queue.put(("resume", int(n)))

    def rewind(self, iteration: int) -> None:
        """A restarted trainer resumes after iteration ``iteration``: loggers drop what they recorded of the
        iterations after it (``Logger.rewind``), in order with every record queued before."""
        with self._lock:
            if not self._finished:
                self._queue.put(("rewind", int(iteration)))

    @ray.method(concurrency_group=CONTROL)
    def env_steps(self) -> int:
        with self._lock:
            return self._env_steps

    @ray.method(concurrency_group=CONTROL)
    def latest(self) -> dict[str, float]:
        """The latest value of every metric, plus ``env_steps``, ``logger/errors``, ``logger/queue``."""
        with self._lock:
            out = dict(self._latest)
            out["env_steps"] = float(self._env_steps)
            out["logger/errors"] = float(len(self._errors))
        out["logger/queue"] = float(self._queue.qsize())
        return out

    @ray.method(concurrency_group=CONTROL)
    def errors(self) -> list[str]:
        """One line per failed logger: its name, where it failed and the exception."""
        with self._lock:
            return list(self._errors)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Block until everything enqueued before this call reached the loggers; True if it did."""
        done = threading.Event()
        with self._lock:
            if self._finished:
                return True
            self._queue.put(("flush", done))
        return done.wait(timeout)

    def video_path(self, key: str, step: int, filename: str | None = None) -> str:
        return os.path.join(self.video_dir, os.path.basename(filename) if filename else video_filename(key, step))

    def finish(self) -> dict[str, float]:
        """Drain the queue, finish every logger, return the summary (latest values). Idempotent."""
        with self._lock:
            if self._finished:
                return dict(self._summary or {})
            self._finished = True
            self._queue.put(_STOP)
        self._thread.join()
        for logger in self._active():
            self._call(logger, "finish")
        summary = self.latest()
        summary.pop("logger/queue", None)
        with self._lock:
            self._summary = summary
        return dict(summary)

    # ----- consumer side -------------------------------------------------------------------

    def _active(self) -> list[Logger]:
        with self._lock:
            return list(self._loggers)

    def _feed(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self._dispatch(item)
            except Exception:  # noqa: BLE001 - the feeder must outlive any single bad item
                log.error("LoggerHub: could not dispatch %s:\n%s", item[0], traceback.format_exc())

    def _dispatch(self, item: tuple) -> None:
        kind = item[0]
        if kind == "flush":
            item[1].set()
        elif kind in ("resume", "rewind"):
            for logger in self._active():
                self._call(logger, kind, item[1])
        elif kind == "metrics":
            _, metrics, step = item
            for logger in self._active():
                self._call(logger, "log_metrics", metrics, step)
        elif kind == "histogram":
            _, key, values, step = item
            for logger in self._active():
                self._call(logger, "log_histogram", key, values, step)
        elif kind == "video":
            _, key, mp4, step, filename = item
            path = self.video_path(key, step, filename)
            base, n = path[: -len(".mp4")] if path.endswith(".mp4") else path, 1
            while os.path.exists(path):  # two workers' videos at one step must not overwrite
                path = f"{base}_{n}.mp4"
                n += 1
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = path + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(mp4)
                os.replace(tmp, path)  # loggers never see a half-written file
            except OSError:
                log.error("LoggerHub: could not write video %s:\n%s", path, traceback.format_exc())
                with self._lock:
                    self._errors.append(f"video {key}: could not write {path}")
                return
            for logger in self._active():
                self._call(logger, "log_video", key, path, step)

    def _call(self, logger: Logger, method: str, *args: Any) -> None:
        try:
            getattr(logger, method)(*args)
        except Exception:  # noqa: BLE001 - isolate the failing logger, keep the others
            with self._lock:
                if logger in self._loggers:
                    self._loggers.remove(logger)
            self._record_failure(type(logger).name or type(logger).__name__, method, traceback.format_exc())

    def _record_failure(self, name: str, method: str, tb: str) -> None:
        log.error("LoggerHub: logger %r failed in %s and is disabled for the rest of the run:\n%s", name, method, tb)
        last = last_line(tb)
        with self._lock:
            self._errors.append(f"{name}.{method}: {last}")


def start_logger_hub(
    *, run_name: str, namespace: str = NAMESPACE, lifetime: str | None = None, wait: bool = True, **kwargs: Any
) -> ActorHandle[LoggerHub]:
    """Start the hub as the named actor ``{run_name}/logger_hub`` and wait until its loggers exist
    (``wait=False``: return at once; ``check_logger_hub`` waits later, so the driver can start the
    rollout manager meanwhile).

    Producer methods, ``flush`` and ``finish`` share one thread (per-producer order is kept);
    queries have a group of 4 threads of their own.

    ``kwargs`` are ``LoggerHub``'s constructor arguments. ``lifetime="detached"`` keeps the hub
    alive after the driver exits (used with ``detach_rollout_manager``).
    """
    from mineonline_core.services.names import on_node

    actor_cls = ray.remote(**ACTOR_OPTIONS)(LoggerHub)
    # On the driver's node with the other bookkeeping actors (driver/placement.py).
    hub = actor_cls.options(
        name=actor_name(run_name, LOGGER_HUB), namespace=namespace, lifetime=lifetime, scheduling_strategy=on_node()
    ).remote(**kwargs)
    if wait:
        check_logger_hub(hub, run_name)
    return hub


def check_logger_hub(hub: ActorHandle[LoggerHub], run_name: str) -> None:
    """Wait until the hub's loggers exist; log each one that failed to start."""
    errors = ray.get(hub.errors.remote())  # constructor errors surface here, not at the first metric
    for line in errors:
        log.error("LoggerHub for run %r: %s", run_name, line)


def get_logger_hub(run_name: str, *, namespace: str = NAMESPACE) -> ActorHandle[LoggerHub]:
    """The hub of a running run (e.g. for a detached rollout manager started by another driver)."""

    return ray.get_actor(actor_name(run_name, LOGGER_HUB), namespace=namespace)


def restarted_config(config: dict, run_dir: str) -> dict:
    """``config`` as a restarted hub hands it to its loggers: a resume of the run's own directory, so that each
    logger reopens what it kept (``Logger.resumed_run_id``)."""
    train = dict(config.get("train_config") or {})
    train["resume"] = train.get("resume") or run_dir
    return {**config, "train_config": train}
