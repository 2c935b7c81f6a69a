"""``RolloutManager``: the named actor that owns a run's rollout side.

It starts the store host, the ``ReplayBuffer`` and ``EpisodeStatistics`` actors, the shared
``InferenceServer`` (``rollout_config.inference: shared``) and the ``num_rollout_workers`` ``RolloutWorker``
actors (``startup.py``: what starts, in which order, where), and owns them. Ray restarts a killed worker
(``max_restarts=-1``); the restarted worker registers again and receives the latest weights, which
the manager keeps for that reason (the restarted server asks ``latest_weights`` again). With a shared
server, weights go to it instead of the workers (``weight_receivers``).

A monitor thread aggregates the workers' counters, and the server's ``rollout/inference_*``, into
``rollout/*`` and ``perf/*`` metrics and checks that every actor is alive: a worker whose thread
failed, a dead buffer, or a statistics or store actor dead past its in-place restarts
(``services/restarts.py``), fails the run through ``health()`` with the cause.
The workers' lives, their heartbeats, the hung ones killed and the restart budget are the
``WorkerSupervisor``'s (``supervision.py``).

The run's env-step count is the logging actor's (``LoggerHub.env_steps``: the workers add to it, a
resume sets it to the checkpoint's), not a second tally of the workers' counters: ``rollout/env_steps``,
``status()`` and the rate are read from it, and each rollout record is stamped with the count it shows.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.rollout.startup import RolloutSpec, start_rollout_actors, store_failure
from mineonline_core.rollout.supervision import WorkerSupervisor
from mineonline_core.services import names
from mineonline_core.services.names import NAMESPACE, actor_name, on_node
from mineonline_core.services.loggerhub import ENV_STEPS
from mineonline_core.services.runlog import setup_actor_logging

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.rollout.inference import InferenceServer
    from mineonline_core.rollout.worker import RolloutWorker
    from mineonline_core.services.handles import StoreAccess
    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)


class RolloutManager:
    """Threaded Ray actor; start it with ``launch_rollout_manager``."""

    def __init__(self, *, spec: RolloutSpec, report_interval: float = 2.0) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        import ray

        config = spec.config
        self.config, self.run_name = config, str(config.run_name)
        self._hub, self._report_interval = spec.logger_hub, report_interval
        self._latest: tuple[list, int] | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._stop_requested = False
        self._lock = threading.Lock()
        self._env_steps = 0.0  # the hub's count as last read
        actors = start_rollout_actors(manager=ray.get_runtime_context().current_actor, spec=spec)
        self._store_host, self._store, self._stats = actors.store_host, actors.store, actors.stats
        self._buffer, self._server, self._workers = actors.buffer, actors.server, actors.workers
        self._first_incarnation = actors.first_incarnation  # per worker: past every stream in a resumed store
        self._store_path = actors.store_path
        self._supervisor = WorkerSupervisor(workers=self._workers, buffer=self._buffer, config=config, fail=self._fail)
        if actors.error is not None:
            self._error = actors.error
            return
        self._origin = (time.monotonic(), 0.0)  # (time, env steps) rollout started from: the run's mean rate
        self._monitor = threading.Thread(target=self._monitor_loop, name="rollout-monitor", daemon=True)
        self._monitor.start()

    # -- weights and workers ------------------------------------------------------------------

    def update_weights(self, weights: list, version: int, forward: bool = True) -> None:
        """``weights[0]`` refers to a CPU state dict of numpy arrays. Returns at once. ``forward=False``:
        the trainer delivered them to the workers itself; only record them and tell the buffer."""
        with self._lock:
            if self._latest is not None and version < self._latest[1]:
                return  # an older broadcast overtaken by a newer one
            self._latest = (weights, int(version))
        self._buffer.set_version.remote(int(version))
        for receiver in self.weight_receivers() if forward else ():
            receiver.update_weights.remote(weights, int(version))

    def weight_receivers(self) -> list[ActorHandle[RolloutWorker] | ActorHandle[InferenceServer]]:
        """The actors that run the rollout policy and take ``update_weights``: the workers, or the
        shared inference server."""
        return list(self._workers) if self._server is None else [self._server]

    def latest_weights(self) -> tuple[list, int] | None:
        """The latest ``(weights, version)`` published (a restarted inference server asks)."""
        with self._lock:
            return self._latest

    def register_worker(self, worker_id: int, pid: int = 0, node: str = "") -> tuple[int, tuple[list, int] | None]:
        """Called by each worker life: its incarnation number and the latest weights (or None).
        ``pid`` and ``node``: where this life runs (what a hang names)."""
        restarts = self._supervisor.register(worker_id, pid=pid, node=node)
        with self._lock:
            latest = self._latest
        return self._first_incarnation.get(worker_id, 0) + restarts, latest

    def latest_version(self) -> int | None:
        """The version of the latest weights published, or None before the first."""
        return None if self._latest is None else self._latest[1]

    def record_videos(self) -> None:
        for worker in self._workers:
            worker.record_video.remote()

    def get_buffer(self) -> ActorHandle[ReplayBuffer]:
        return self._buffer

    def get_store_client(self) -> StoreAccess:
        return self._store

    def get_workers(self) -> list[ActorHandle[RolloutWorker]]:
        return list(self._workers)

    def get_inference_server(self) -> ActorHandle[InferenceServer] | None:
        """The shared inference server, or None with ``inference: local``."""
        return self._server

    def wait_ready(self, timeout: float) -> None:
        """Return once every worker has built and reset its envs; raise on failure or timeout."""
        import ray

        end = time.monotonic() + timeout
        while True:
            self.health()
            if all(ray.get([w.is_ready.remote() for w in self._workers], timeout=max(1.0, end - time.monotonic()))):
                return
            if time.monotonic() > end:
                raise RunFailedError(f"rollout workers of run {self.run_name!r} were not ready after {timeout:.0f}s")
            time.sleep(0.1)

    # -- health, status, lifecycle ------------------------------------------------------------

    def health(self) -> None:
        """Raise the first failure the monitor saw (a worker's thread, a dead buffer or stats actor)."""
        if self._error is not None:
            raise self._error

    def status(self) -> dict[str, Any]:
        import ray

        workers = []
        for i, worker in enumerate(self._workers):
            try:
                workers.append(ray.get(worker.status.remote(), timeout=5))
            except Exception as exc:  # noqa: BLE001 - a restarting worker is reported, not fatal
                workers.append({"worker_id": i, "error": f"{type(exc).__name__}"})
        try:
            buffer = ray.get(self._buffer.stats.remote(), timeout=5)
        except Exception as exc:  # noqa: BLE001
            buffer = {"error": f"{type(exc).__name__}"}
        return {
            "run_name": self.run_name,
            "version": None if self._latest is None else self._latest[1],
            "env_steps": int(self._env_steps),
            "buffer_size": buffer.get("replay/size"),
            "buffer": buffer,
            "workers": workers,
            "incarnations": dict(self._supervisor.incarnations),
            "error": None if self._error is None else repr(self._error),
            "stop_requested": self._stop_requested,
        }

    def diagnose(self) -> list[str]:
        """One line per rollout worker (life, env steps, last error) and the replay buffer's reason
        for serving no chunk: what a stalled run reports."""
        import ray

        lines = self._supervisor.worker_lines()
        if self._error is not None:
            lines.insert(0, f"the rollout side failed: {self._error}")
        train_config = self.config.train_config
        try:
            lines.append(
                "replay buffer: "
                + ray.get(
                    self._buffer.explain.remote(train_config.batches_per_iteration * train_config.batch_size_per_gpu),
                    timeout=10,
                )
            )
        except Exception as exc:  # noqa: BLE001 - a dead buffer is itself the diagnosis
            lines.append(f"replay buffer: no answer ({type(exc).__name__}: {exc})")
        return lines

    def request_stop(self) -> None:
        """Ask the run to stop (the trainer polls ``stop_requested`` between iterations; one waiting
        for chunks is released by the buffer at once)."""
        self._stop_requested = True
        self._buffer.stop_waiting.remote()

    def stop_requested(self) -> bool:
        return self._stop_requested

    def shutdown(self) -> None:
        """Stop the workers (closing their env processes), then end the actors this manager started."""
        import ray

        self._stop.set()
        self._monitor.join(timeout=60)
        refs = [w.shutdown.remote() for w in self._workers]
        try:
            ray.get(refs, timeout=30)
        except Exception:  # noqa: BLE001 - dead or stuck workers are killed below
            log.warning("some rollout workers did not shut down cleanly", exc_info=True)
        # A last report once the workers stopped (their last steps reached the hub before their shutdown
        # returned), so the run's summary has the final figures and ``rollout/env_steps`` the final count.
        reports = self._supervisor.worker_reports()
        if self._hub is not None and reports:
            # Waited for: the driver finishes the hub next, and Ray orders calls per caller only.
            try:
                metrics = {**self._aggregate(reports), **self._server_report()}
                # The run's mean, so that a run shorter than a few report intervals (whose windows all
                # fell before the first fragments) does not end on a rate of 0.
                origin_time, origin_total = self._origin
                rate = (metrics[ENV_STEPS] - origin_total) / max(time.monotonic() - origin_time, 1e-9)
                metrics["rollout/env_steps_per_s"] = max(rate, 0.0)
                ray.get(self._hub.log_metrics.remote(metrics), timeout=30)  # stamped by the hub: never behind
            except Exception:  # noqa: BLE001 - a dead logging actor must not keep the workers running
                log.warning("the final rollout report did not reach the logging actor", exc_info=True)
        try:  # episodes since the last report_every-th one reach the metrics too (the workers flushed theirs)
            ray.get(self._stats.report.remote(), timeout=60)
        except Exception:  # noqa: BLE001
            log.warning("the episode statistics actor did not report at shutdown", exc_info=True)
        try:
            ray.get(self._store_host.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001
            log.warning("the store host did not close cleanly", exc_info=True)
        server = [self._server] if self._server is not None else []
        for actor in [*self._workers, *server, self._buffer, self._stats, self._store_host]:
            ray.kill(actor, no_restart=True)

    # -- monitor ------------------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        # From the count the run starts at: a resumed run's first rate must not include the checkpoint's steps.
        last_time, last_total = time.monotonic(), self._read_env_steps()
        self._origin = (last_time, last_total)
        while not self._stop.wait(self._report_interval):
            # Bookkeeping actors first: when one dies, workers fail too, and the root cause
            # should be the error the driver sees.
            self._check_bookkeeping()
            reports = self._supervisor.worker_reports(wait=self._report_interval)
            self._supervisor.kill_hung()
            now = time.monotonic()
            metrics = {**self._aggregate(reports), **self._server_report()}
            total = self._env_steps
            metrics["rollout/env_steps_per_s"] = max(total - last_total, 0.0) / max(now - last_time, 1e-9)
            last_time, last_total = now, total
            if self._hub is not None and reports:
                self._hub.log_metrics.remote(metrics)  # stamped on arrival, so the step axis never goes back

    def _check_bookkeeping(self) -> None:
        import ray

        bookkeeping = (
            ("replay buffer", self._buffer),
            ("episode statistics", self._stats),
            ("replay store host", self._store_host),
        )
        for name, actor in bookkeeping:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.RayActorError as exc:
                if actor is self._store_host:
                    exc = store_failure(exc, "the replay store host", self._store_path, running=True)
                self._fail(exc, f"the {name} actor died")
            except ray.exceptions.GetTimeoutError:
                log.warning("the %s actor did not answer within 30s", name)

    def _server_report(self) -> dict[str, float]:
        import ray

        if self._server is None:
            return {}
        try:
            return ray.get(self._server.metrics.remote(), timeout=30)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.ActorUnavailableError,
            ray.exceptions.GetTimeoutError,
        ) as exc:
            log.warning("the inference server did not report (%s); Ray restarts a dead one", last_line(exc, limit=300))
        except Exception as exc:  # noqa: BLE001 - one of its threads failed: the run cannot collect
            self._fail(exc, "the rollout inference server failed")
        return {}

    def _aggregate(self, reports: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
        sums: dict[str, float] = {}
        means: dict[str, list[float]] = {}
        for _, report in reports:
            for key, value in report.items():
                if key.startswith("perf/") or key == "rollout/model_version":
                    means.setdefault(key, []).append(value)
                else:
                    sums[key] = sums.get(key, 0.0) + value
        out = {**sums, **{k: sum(v) / len(v) for k, v in means.items()}}
        out[ENV_STEPS] = self._read_env_steps()  # the run's count, not this life's of each worker
        out["rollout/worker_restarts"] = float(sum(self._supervisor.incarnations.values()))
        out["rollout/worker_hangs"] = float(self._supervisor.hangs)
        return out

    def _read_env_steps(self) -> float:
        """The run's env-step count from the logging actor (the last one read when it does not answer)."""
        import ray

        if self._hub is not None:
            try:
                self._env_steps = float(ray.get(self._hub.env_steps.remote(), timeout=30))
            except ray.exceptions.RayError:  # a timeout too
                log.warning(
                    "the logging actor did not tell the env-step count; showing the last one read", exc_info=True
                )
        return self._env_steps

    def _fail(self, exc: BaseException, what: str) -> None:
        if self._error is None:
            log.error("%s: %s", what, exc)
            self._error = exc if isinstance(exc, RunFailedError) else RunFailedError(f"{what}: {exc}")


def launch_rollout_manager(
    *,
    policy_generator: Callable[[], Any],
    env_generator: Callable[[], Any],
    config: Any,
    logger_hub: ActorHandle[LoggerHub] | None = None,
    store_cls: type | None = None,
    store_options: Any = None,
) -> ActorHandle[RolloutManager]:
    """Start the run's named ``RolloutManager`` actor: the one place it is started (``run``, the public
    ``start_rolloutmanager`` and tests all come here). Detached when ``detach_rollout_manager``.

    ``config`` is a validated ``OnlineConfig``; ``env_generator`` must already return adapted envs.
    ``store_cls`` is the class registered as ``database_config.backend``; the driver looks it up (so
    that an unknown name fails before Ray starts) and passes it in; when omitted it is looked up here.
    Returns the actor handle once the manager is constructed (its errors are raised here).
    """
    import ray

    if store_cls is None:
        from mineonline_core.registry import get_plugin_manager

        backend = config.rollout_config.replay_buffer_config.database_config.backend
        store_cls = get_plugin_manager().lookup("replay_store", backend)
    options: dict[str, Any] = {
        "name": actor_name(config.run_name, names.ROLLOUT_MANAGER),
        "namespace": NAMESPACE,
        "num_cpus": 0,
        "max_concurrency": 16,
        "scheduling_strategy": on_node(),
    }
    if config.detach_rollout_manager:
        options["lifetime"] = "detached"
    # The manager, and the store, buffer and statistics it starts, live on the node that starts the run
    # (the one whose disk holds database_config.path): the driver dies with that node anyway.
    manager = (
        ray.remote(RolloutManager)
        .options(**options)
        .remote(
            spec=RolloutSpec(
                policy_generator=policy_generator,
                env_generator=env_generator,
                config=config,
                store_cls=store_cls,
                store_options=store_options,
                logger_hub=logger_hub,
                store_node_id=ray.get_runtime_context().get_node_id(),
            )
        )
    )
    try:
        ray.get(manager.health.remote())
    except Exception:
        ray.kill(manager)  # with it go the actors it started (they are owned by it)
        raise
    return manager


def get_rollout_manager(run_name: str) -> ActorHandle[RolloutManager]:
    """The handle of a running run's manager (``ValueError`` when none runs under that name)."""
    import ray

    return ray.get_actor(actor_name(run_name, names.ROLLOUT_MANAGER), namespace=NAMESPACE)
