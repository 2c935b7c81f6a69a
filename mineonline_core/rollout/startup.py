"""What a run's rollout side starts, in order: the replay store, the bookkeeping actors, the workers.

The ``RolloutManager`` calls ``start_rollout_actors`` from its constructor and owns what it returns
(``RolloutActors``). It starts the store host (``mineonline_core.services.storehost``) and its client, the
``EpisodeStatistics`` and ``ReplayBuffer`` actors (``num_cpus=0``: bookkeeping must never take a CPU slot from
rollout or training; pinned with the manager to the driver's node, ``driver/placement.py``), rebuilds the buffer
from a resumed persistent store (new streams then start past every stored incarnation), starts the run's
``InferenceServer`` with ``rollout_config.inference: shared`` and the ``num_rollout_workers`` ``RolloutWorker``
actors (Ray restarts a killed one: ``max_restarts=-1``), and waits for the store to open. A store that fails
is recorded in ``RolloutActors.error`` with its cause (``store_failure``), not raised: an exception out of the
manager's (threaded) constructor left its process alive and the driver's first call to it waiting forever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from mineonline_core.contracts.fragment import parse_fragment_key, parse_stream
from mineonline_core.config.checks import inference_resources
from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.errors import RunFailedError, find_user_error
from mineonline_core.services import names
from mineonline_core.services.names import NAMESPACE, actor_name, on_node

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.rollout.inference import InferenceServer
    from mineonline_core.rollout.stats import EpisodeStatistics
    from mineonline_core.rollout.worker import RolloutWorker
    from mineonline_core.services.handles import RolloutManagerHandle, StoreAccess
    from mineonline_core.services.loggerhub import LoggerHub
    from mineonline_core.services.storehost import StoreHost

log = logging.getLogger(__name__)

WORKER_CONCURRENCY = 8


@dataclass(frozen=True)
class RolloutSpec:
    """What a run's rollout side is built from: ``launch_rollout_manager`` hands it to the manager, which
    hands it to ``start_rollout_actors``. ``config`` is the validated ``OnlineConfig``; ``store_cls`` the
    class registered as ``database_config.backend``; ``store_options`` its validated options (default:
    validated here from ``database_config``); ``store_node_id`` the node whose disk holds the store
    (default: the manager's)."""

    policy_generator: Callable[[], Any]
    env_generator: Callable[[], Any]
    config: Any
    store_cls: type
    store_options: Any = None
    logger_hub: ActorHandle[LoggerHub] | None = None
    store_node_id: str | None = None


@dataclass
class RolloutActors:
    """The handles ``start_rollout_actors`` started (None or empty past a failure), and the first failure."""

    store_path: str = ""  # database_config.path, resolved
    store_host: ActorHandle[StoreHost] | None = None
    store: StoreAccess | None = None  # the ``StoreClient`` every worker and the buffer use
    stats: ActorHandle[EpisodeStatistics] | None = None
    buffer: ActorHandle[ReplayBuffer] | None = None
    server: ActorHandle[InferenceServer] | None = None  # the shared inference server, or None
    workers: list[ActorHandle[RolloutWorker]] = field(default_factory=list)
    first_incarnation: dict[int, int] = field(default_factory=dict)  # per worker: past every stored stream
    error: BaseException | None = None


def start_rollout_actors(*, manager: RolloutManagerHandle, spec: RolloutSpec) -> RolloutActors:
    """Start the rollout side of ``spec``'s run for ``manager`` (its handle: the workers and the server
    register with it); returns once the store is open or has failed."""
    import ray

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.rollout.stats import ACTOR_OPTIONS as STATS_OPTIONS, EpisodeStatistics
    from mineonline_core.rollout.worker import RolloutWorker
    from mineonline_core.services.storehost import StoreClient, start_store_host

    config, store_cls, logger_hub = spec.config, spec.store_cls, spec.logger_hub
    policy_generator, env_generator, store_options = spec.policy_generator, spec.env_generator, spec.store_options
    run_name, rollout_config = str(config.run_name), config.rollout_config
    bc = rollout_config.replay_buffer_config
    db = bc.database_config
    path, resume = str(config.resolve_path(db.path)), config.train_config.resume is not None
    actors = RolloutActors(store_path=path)
    store_node_id = spec.store_node_id or ray.get_runtime_context().get_node_id()
    if store_options is None:
        store_options = store_cls.Config(**(db.model_extra or {}))
    actors.store_host = start_store_host(
        store_cls=store_cls,
        path=path,
        num_shards=db.num_shards,
        resume=resume,
        options=store_options,
        namespace=NAMESPACE,
        node_id=store_node_id,
        name=actor_name(run_name, names.STORE_HOST),
        logger_hub=logger_hub,
    )
    # The host is pinned to that node, so the client is made without waiting for the store to open:
    # the workers below start their processes meanwhile. Nothing is stored before the first weights
    # arrive, and the trainer sends them only after the manager's constructor has waited for the store.
    actors.store = StoreClient(
        host=actors.store_host,
        store_cls=store_cls,
        path=path,
        num_shards=db.num_shards,
        options=store_options,
        host_node_id=store_node_id,
    )
    # Pinned with the store host to the driver's node: a node's death costs only workers (placement.py).
    small = {"num_cpus": 0, "namespace": NAMESPACE, "scheduling_strategy": on_node(store_node_id)}
    actors.stats = (
        ray.remote(EpisodeStatistics)
        .options(name=actor_name(run_name, names.EPISODE_STATISTICS), **{**small, **STATS_OPTIONS})
        .remote(logger_hub=logger_hub, window=rollout_config.episode_statistics_config.window)
    )
    actors.buffer = (
        ray.remote(ReplayBuffer)
        .options(name=actor_name(run_name, names.REPLAY_BUFFER), **small)
        .remote(
            store_client=actors.store,
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
            rebuilt = ray.get(actors.buffer.rebuild_from_store.remote())
        except ray.exceptions.RayError as exc:
            # Recorded, not raised: an exception out of the manager's (threaded) constructor left
            # its process alive and the driver's first call to it waiting forever.
            actors.error = store_failure(exc, "the replay buffer", path)
            return actors
        log.info("replay buffer rebuilt %d chunks from %s", rebuilt, path)
        # New streams must not reuse a stored stream's keys: a put would overwrite its payloads.
        actors.first_incarnation = first_free_incarnations(actors.store.keys())
    precision = PrecisionChoice.from_config(config.train_config)
    server_cpus, server_gpus, worker_gpus = inference_resources(rollout_config)
    if rollout_config.inference == "shared":
        from mineonline_core.rollout.inference import InferenceServer

        actors.server = (
            ray.remote(InferenceServer)
            .options(
                name=actor_name(run_name, names.INFERENCE_SERVER),
                namespace=NAMESPACE,
                num_cpus=server_cpus,
                num_gpus=server_gpus,
                max_concurrency=2 * rollout_config.num_rollout_workers + 8,
                max_restarts=-1,
                max_task_retries=-1,
            )
            .remote(policy_generator=policy_generator, config=rollout_config, manager=manager, precision=precision)
        )
    worker_cls = ray.remote(RolloutWorker)
    actors.workers = [
        worker_cls.options(
            name=actor_name(run_name, names.ROLLOUT_WORKER, i),
            namespace=NAMESPACE,
            num_cpus=rollout_config.num_cpus_per_worker,
            num_gpus=worker_gpus,
            max_concurrency=WORKER_CONCURRENCY,
            max_restarts=-1,
            max_task_retries=-1,
        ).remote(
            worker_id=i,
            config=rollout_config,
            policy_generator=policy_generator,
            env_generator=env_generator,
            store_client=actors.store,
            buffer=actors.buffer,
            stats=actors.stats,
            logger_hub=logger_hub,
            manager=manager,
            discount=config.train_config.discount,
            seed=config.seed + 7 * i,
            precision=precision,
            inference_server=actors.server,
        )
        for i in range(rollout_config.num_rollout_workers)
    ]
    try:
        ray.get(actors.store_host.node_id.remote())  # the store is open, or its error is raised here
    except ray.exceptions.RayError as exc:
        actors.error = store_failure(exc, "the replay store host", path)
        return actors
    return actors


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
