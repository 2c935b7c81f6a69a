"""``RolloutManager``: the named actor that owns a run's rollout side.

It starts the store host (``mineonline_core.services.storehost``), the ``ReplayBuffer`` and
``EpisodeStatistics`` actors (``num_cpus=0``: bookkeeping must never take a CPU slot from rollout
or training; pinned with the manager to the driver's node, ``driver/placement.py``) and ``num_rollout_workers`` ``RolloutWorker`` actors. Ray restarts a killed worker
(``max_restarts=-1``); the restarted worker registers again and receives the latest weights, which
the manager keeps for that reason. A monitor thread aggregates the workers' counters into
``rollout/*`` and ``perf/*`` metrics and checks that every actor is alive: a worker whose thread
failed, or a dead buffer or statistics actor, fails the run through ``health()`` with the cause.
A worker's answer to ``report()`` is its heartbeat: one silent past ``hang_timeout`` is named (pid,
node, last report) and killed, and Ray restarts it (``services/heartbeat.py``); the buffer is told which
workers are hung or dead, so that a trainer waiting for chunks says so (``ReplayBuffer.explain``).

With ``rollout_config.inference: shared`` it also starts the run's ``InferenceServer`` (restarted by
Ray like a worker; it asks ``latest_weights`` again): weights go to the server instead of the
workers (``weight_receivers``), and its ``rollout/inference_*`` metrics join the workers'.

The run's env-step count is the logging actor's (``LoggerHub.env_steps``: the workers add to it, a
resume sets it to the checkpoint's), not a second tally of the workers' counters: ``rollout/env_steps``,
``status()`` and the rate are read from it, and each rollout record is stamped with the count it shows.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from mineonline_core.config.checks import inference_resources
from mineonline_core.contracts.fragment import parse_fragment_key, parse_stream
from mineonline_core.errors import RunFailedError, find_user_error, last_line
from mineonline_core.services import names
from mineonline_core.services.names import NAMESPACE, actor_name
from mineonline_core.services.names import on_node
from mineonline_core.services.heartbeat import Heartbeats, hung_message
from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.services.restarts import RestartBudget
from mineonline_core.services.runlog import setup_actor_logging

log = logging.getLogger(__name__)

WORKER_CONCURRENCY = 8


class RolloutManager:
    """Threaded Ray actor; start it with ``launch_rollout_manager``."""

    def __init__(
        self,
        *,
        policy_generator: Callable[[], Any],
        env_generator: Callable[[], Any],
        config: Any,
        store_cls: type,
        store_options: Any = None,
        logger_hub: Any = None,
        store_node_id: str | None = None,
        report_interval: float = 2.0,
    ) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        import ray

        from mineonline_core.rollout.buffer import ReplayBuffer
        from mineonline_core.rollout.stats import EpisodeStatistics
        from mineonline_core.rollout.worker import RolloutWorker
        from mineonline_core.services.storehost import StoreClient, start_store_host

        self.config, self.run_name = config, str(config.run_name)
        rc = config.rollout_config
        bc = rc.replay_buffer_config
        db = bc.database_config
        self._hub, self._report_interval = logger_hub, report_interval
        self._latest: tuple[list, int] | None = None
        self._incarnations: dict[int, int] = {}  # restarts in this run, per worker
        self._first_incarnation: dict[int, int] = {}  # per worker: past every stream in a resumed store
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._stop_requested = False
        self._lock = threading.Lock()
        self._env_steps = 0.0  # the hub's count as last read
        self._restarts = RestartBudget(cap=rc.max_worker_restarts, window=rc.restart_window)
        self._last_errors: dict[int, str] = {}  # worker id -> the last failure the monitor saw
        self._beats = Heartbeats(timeout=config.hang_timeout)  # the workers' lives, by worker id
        self._reporting: dict[int, tuple[Any, int]] = {}  # worker id -> its report() call in flight, the life asked
        self._missing: dict[int, str] = {}  # worker id -> why no fragment comes from it now (hung, dead)
        self._hangs = 0

        path, resume = str(config.resolve_path(db.path)), config.train_config.resume is not None
        self._store_path = path
        store_node_id = store_node_id or ray.get_runtime_context().get_node_id()
        if store_options is None:
            store_options = store_cls.Config(**(db.model_extra or {}))
        self._store_host = start_store_host(
            store_cls=store_cls,
            path=path,
            num_shards=db.num_shards,
            resume=resume,
            options=store_options,
            namespace=NAMESPACE,
            node_id=store_node_id,
            name=actor_name(self.run_name, names.STORE_HOST),
        )
        # The host is pinned to that node, so the client is made without waiting for the store to open:
        # the workers below start their processes meanwhile. Nothing is stored before the first weights
        # arrive, and the trainer sends them only after this constructor has waited for the store.
        self._store = StoreClient(
            host=self._store_host,
            store_cls=store_cls,
            path=path,
            num_shards=db.num_shards,
            options=store_options,
            host_node_id=store_node_id,
        )
        # Pinned with the store host to the driver's node: a node's death costs only workers (placement.py).
        small = {"num_cpus": 0, "namespace": NAMESPACE, "scheduling_strategy": on_node(store_node_id)}
        self._stats = (
            ray.remote(EpisodeStatistics)
            .options(name=actor_name(self.run_name, names.EPISODE_STATISTICS), **small)
            .remote(logger_hub=logger_hub, window=rc.episode_statistics_config.window)
        )
        self._buffer = (
            ray.remote(ReplayBuffer)
            .options(name=actor_name(self.run_name, names.REPLAY_BUFFER), **small)
            .remote(
                store_client=self._store,
                max_chunks=bc.max_chunks,
                max_reuse=bc.max_reuse,
                max_staleness=bc.max_staleness,
                fragments_per_chunk=bc.fragments_per_chunk,
                fragments_per_report=bc.fragments_per_report,
                logger_hub=logger_hub,
            )
        )
        if resume and store_cls.persistent:
            try:
                rebuilt = ray.get(self._buffer.rebuild_from_store.remote())
            except ray.exceptions.RayError as exc:
                # Recorded, not raised: an exception out of this (threaded) actor's constructor left
                # its process alive and the driver's first call to it waiting forever.
                self._error = store_failure(exc, "the replay buffer", path)
                return
            log.info("replay buffer rebuilt %d chunks from %s", rebuilt, path)
            # New streams must not reuse a stored stream's keys: a put would overwrite its payloads.
            self._first_incarnation = first_free_incarnations(self._store.keys())
        me = ray.get_runtime_context().current_actor
        self._server = None
        precision = PrecisionChoice.from_config(config.train_config)
        server_cpus, server_gpus, worker_gpus = inference_resources(rc)
        if rc.inference == "shared":
            from mineonline_core.rollout.inference import InferenceServer

            self._server = (
                ray.remote(InferenceServer)
                .options(
                    name=actor_name(self.run_name, names.INFERENCE_SERVER),
                    namespace=NAMESPACE,
                    num_cpus=server_cpus,
                    num_gpus=server_gpus,
                    max_concurrency=2 * rc.num_rollout_workers + 8,
                    max_restarts=-1,
                    max_task_retries=-1,
                )
                .remote(policy_generator=policy_generator, config=rc, manager=me, precision=precision)
            )
        worker_cls = ray.remote(RolloutWorker)
        self._workers = [
            worker_cls.options(
                name=actor_name(self.run_name, names.ROLLOUT_WORKER, i),
                namespace=NAMESPACE,
                num_cpus=rc.num_cpus_per_worker,
                num_gpus=worker_gpus,
                max_concurrency=WORKER_CONCURRENCY,
                max_restarts=-1,
                max_task_retries=-1,
            ).remote(
                worker_id=i,
                config=rc,
                policy_generator=policy_generator,
                env_generator=env_generator,
                store_client=self._store,
                buffer=self._buffer,
                stats=self._stats,
                logger_hub=logger_hub,
                manager=me,
                discount=config.train_config.discount,
                seed=config.seed + 7 * i,
                precision=precision,
                inference_server=self._server,
            )
            for i in range(rc.num_rollout_workers)
        ]
        try:
            ray.get(self._store_host.node_id.remote())  # the store is open, or its error is raised here
        except ray.exceptions.RayError as exc:
            self._error = store_failure(exc, "the replay store host", path)
            return
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

    def weight_receivers(self) -> list[Any]:
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
        with self._lock:
            restarts = self._incarnations.get(worker_id, -1) + 1
            self._incarnations[worker_id] = restarts
            over = bool(restarts) and self._restarts.add()
            latest = self._latest
        self._beats.start(worker_id, pid=pid, node=node, detail=f"life {restarts} registered")
        self._set_missing(worker_id, None)
        if restarts:
            log.warning("rollout worker %d restarted (life %d); sending it the latest weights", worker_id, restarts)
        if over:
            rc = self.config.rollout_config
            self._fail(
                RunFailedError(
                    f"rollout workers were restarted {self._restarts.count()} times within {self._restarts.span():.0f}s "
                    f"(rollout_config.max_worker_restarts={rc.max_worker_restarts} per restart_window="
                    f"{rc.restart_window:g}s), so the run stops instead of restarting them forever.\n"
                    + "\n".join(f"  - {line}" for line in self._worker_lines())
                    + "\nFix the cause above (a worker that dies at every start), or raise max_worker_restarts."
                ),
                "too many rollout worker restarts",
            )
        return self._first_incarnation.get(worker_id, 0) + restarts, latest

    def latest_version(self) -> int | None:
        """The version of the latest weights published, or None before the first."""
        return None if self._latest is None else self._latest[1]

    def record_videos(self) -> None:
        for worker in self._workers:
            worker.record_video.remote()

    def get_buffer(self) -> Any:
        return self._buffer

    def get_store_client(self) -> Any:
        return self._store

    def get_workers(self) -> list[Any]:
        return list(self._workers)

    def get_inference_server(self) -> Any:
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
            "incarnations": dict(self._incarnations),
            "error": None if self._error is None else repr(self._error),
            "stop_requested": self._stop_requested,
        }

    def diagnose(self) -> list[str]:
        """One line per rollout worker (life, env steps, last error) and the replay buffer's reason
        for serving no chunk: what a stalled run reports."""
        import ray

        lines = self._worker_lines()
        if self._error is not None:
            lines.insert(0, f"the rollout side failed: {self._error}")
        tc = self.config.train_config
        try:
            lines.append(
                "replay buffer: "
                + ray.get(self._buffer.explain.remote(tc.batches_per_iteration * tc.batch_size_per_gpu), timeout=10)
            )
        except Exception as exc:  # noqa: BLE001 - a dead buffer is itself the diagnosis
            lines.append(f"replay buffer: no answer ({type(exc).__name__}: {exc})")
        return lines

    def _worker_lines(self) -> list[str]:
        import ray

        lines = []
        for i, worker in enumerate(self._workers):
            try:
                s = ray.get(worker.status.remote(), timeout=5)
                state = f"life {s['incarnation']}, {s['env_steps']} env steps, {s['fragments_sent']} fragments sent, ready={s['ready']}"
                error = s["error"] or self._last_errors.get(i)
            except Exception as exc:  # noqa: BLE001 - dead or restarting: say so
                state, error = (
                    f"not answering ({type(exc).__name__})",
                    self._last_errors.get(i) or last_line(exc, limit=300),
                )
            lines.append(f"rollout worker {i}: {state}; last error: {error or 'none'}")
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
        reports = self._worker_reports()
        if self._hub is not None and reports:
            # Waited for: the driver finishes the hub next, and Ray orders calls per caller only.
            try:
                metrics = {**self._aggregate(reports), **self._server_report()}
                ray.get(self._hub.log_metrics.remote(metrics, int(metrics["rollout/env_steps"])), timeout=30)
            except Exception:  # noqa: BLE001 - a dead logging actor must not keep the workers running
                log.warning("the final rollout report did not reach the logging actor", exc_info=True)
        try:  # episodes since the last report_every-th one reach the metrics too (the workers flushed theirs)
            ray.get(self._stats.report.remote(), timeout=30)
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
        while not self._stop.wait(self._report_interval):
            # Bookkeeping actors first: when one dies, workers fail too, and the root cause
            # should be the error the driver sees.
            self._check_bookkeeping()
            reports = self._worker_reports(wait=self._report_interval)
            self._kill_hung()
            now = time.monotonic()
            metrics = {**self._aggregate(reports), **self._server_report()}
            total = self._env_steps
            metrics["rollout/env_steps_per_s"] = max(total - last_total, 0.0) / max(now - last_time, 1e-9)
            last_time, last_total = now, total
            if self._hub is not None and reports:
                self._hub.log_metrics.remote(metrics, int(total))

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

    def _worker_reports(self, wait: float = 30.0) -> list[tuple[int, dict[str, float]]]:
        """The reports answered within ``wait`` seconds. One call per worker is in flight at a time, so
        a frozen worker delays no other's report; its silence is timed by ``_beats``."""
        import ray

        for i, worker in enumerate(self._workers):
            if i not in self._reporting:
                self._reporting[i] = (worker.report.remote(), self._incarnations.get(i, -1))
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
                if life == self._incarnations.get(i, -1):  # not a life that registered since the call
                    self._beats.forget(i)  # being restarted by Ray; it re-registers and gets the latest weights
                    self._set_missing(i, f"rollout worker {i} died and is being restarted ({self._last_errors[i]})")
                continue
            except Exception as exc:  # noqa: BLE001 - a worker's background thread failed
                self._fail(exc, f"rollout worker {i} failed")
                continue
            reports.append((i, report))
            self._beats.beat(i, f"{int(report.get('rollout/fragments_sent', 0))} fragments sent")
        return reports

    def _kill_hung(self) -> None:
        """Name and kill every worker silent past ``hang_timeout``: Ray restarts it like a crashed one."""
        import ray

        for i, beat, silent_for in self._beats.silent():
            life = self._incarnations.get(i, 0)
            message = hung_message(
                f"rollout worker {i} (life {life})",
                beat,
                silent_for,
                self._beats.timeout,
                "Killing it; Ray restarts it like a crashed worker.",
            )
            log.error("%s", message)
            self._beats.forget(i)
            self._hangs += 1
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
        out["rollout/env_steps"] = self._read_env_steps()  # the run's count, not this life's of each worker
        out["rollout/worker_restarts"] = float(sum(self._incarnations.values()))
        out["rollout/worker_hangs"] = float(self._hangs)
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


def store_failure(exc: BaseException, who: str, path: str, *, running: bool = False) -> BaseException:
    """The error a failed or dead store actor ends the run with: the store's own error when it raised
    one (a damaged shard names itself), else the store's path and what to do about it."""
    user_error = find_user_error(exc)
    if user_error is not None:
        return user_error
    when = "while the run was using it" if running else "while opening it"
    return RunFailedError(
        f"{who} died {when}, with the replay store at database_config.path={path!r} "
        f"({type(exc).__name__}). A damaged data.mdb under that path kills the process "
        "that maps it (SIGBUS); the actor's log says how it ended. Resume the run again (mineonline run --resume "
        f"RUN_DIR); if the store fails again, move {path!r} aside to resume with an empty replay store. The "
        "checkpoints are not affected."
    )


def first_free_incarnations(keys: list[str]) -> dict[int, int]:
    """Per worker id, one past the highest incarnation among stored fragment keys
    (``fragment.parse_fragment_key`` and ``fragment.parse_stream``)."""
    out: dict[int, int] = {}
    for key in keys:
        parsed = parse_fragment_key(key)
        stream = parse_stream(parsed[0]) if parsed else None
        if stream is not None:
            worker_id, incarnation, _ = stream
            out[worker_id] = max(out.get(worker_id, 0), incarnation + 1)
    return out


def launch_rollout_manager(
    *,
    policy_generator: Callable[[], Any],
    env_generator: Callable[[], Any],
    config: Any,
    logger_hub: Any = None,
    store_cls: type | None = None,
    store_options: Any = None,
) -> Any:
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
            policy_generator=policy_generator,
            env_generator=env_generator,
            config=config,
            store_cls=store_cls,
            store_options=store_options,
            logger_hub=logger_hub,
            store_node_id=ray.get_runtime_context().get_node_id(),
        )
    )
    try:
        ray.get(manager.health.remote())
    except Exception:
        ray.kill(manager)  # with it go the actors it started (they are owned by it)
        raise
    return manager


def get_rollout_manager(run_name: str) -> Any:
    """The handle of a running run's manager (``ValueError`` when none runs under that name)."""
    import ray

    return ray.get_actor(actor_name(run_name, names.ROLLOUT_MANAGER), namespace=NAMESPACE)
