"""Where a run's actors go on a Ray cluster, and what is refused or reported when they cannot go anywhere.

Bookkeeping on the driver's node. The rollout manager, the replay buffer, the episode statistics,
the logging hub and the store host hold the run's state and take no CPU: they are pinned to the node
of the process that starts the run (``on_node``: hard node affinity, ``soft=False``, as the GPU lease
is). The driver dies with that node anyway, so a node's death costs only the rollout workers and
trainer ranks on it, which Ray and ``trainer/recovery.py`` restart. The shared inference server is not
pinned: it reserves a worker's CPUs and the workers' GPU share, so it is compute, placed by its
resources like a worker (a driver node without a GPU could not hold it) and restarted elsewhere by Ray.

Before anything starts, ``check_placement`` refuses a config whose largest actor (a Ray Train rank, a
rollout worker, the inference server) fits no single node, naming the actor, its resources and what each
node has: the cluster-wide sum (``checks.check_resources``) does not see that. While the run goes on,
``PendingWatch`` reads the GCS's actor and placement-group tables: an actor or rank still waiting for a
node after ``PENDING_BOUND_S`` is named with its resources; when no alive node could ever hold it (its
node died and none like it is left) the run fails with that cause instead of waiting ``progress_timeout``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mineonline_core.config.checks import inference_resources
from mineonline_core.errors import ConfigError, RunFailedError

log = logging.getLogger("mineonline")

#: Seconds an actor or Ray Train rank may wait for a node before it is reported.
PENDING_BOUND_S = 30.0
_EPS = 1e-9


def _shape(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in resources.items() if v}


def _fits(shape: Mapping[str, float], node: Mapping[str, float]) -> bool:
    return all(float(node.get(k, 0.0)) + _EPS >= v for k, v in shape.items())


def _show(shape: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shape.items())) + "}" if shape else "{}"


def _node_line(node: Mapping[str, Any]) -> str:
    res = node.get("Resources") or {}
    have = _shape({k: res.get(k, 0.0) for k in ("CPU", "GPU")})
    where = f"{node.get('NodeManagerAddress', '?')} ({str(node.get('NodeID', '?'))[:8]})"
    return f"{where} {_show(have) if have else '{CPU: 0}'}"


def actor_shapes(cfg: Any) -> list[tuple[str, str, dict[str, float]]]:
    """``(actor, config keys, resources)`` of each actor that reserves resources on one node."""
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    server_cpus, server_gpus, worker_gpus = inference_resources(rollout_config)
    out = [
        (
            "a rollout worker",
            "rollout_config.num_cpus_per_worker / num_gpus_per_worker",
            _shape({"CPU": rollout_config.num_cpus_per_worker, "GPU": worker_gpus}),
        )
    ]
    if rollout_config.inference == "shared":
        out.append(
            (
                "the shared inference server",
                "rollout_config.num_cpus_per_worker / num_gpus_per_worker",
                _shape({"CPU": server_cpus, "GPU": server_gpus}),
            )
        )
    ray_train = train_config.use_ray_train if train_config.use_ray_train is not None else train_config.num_workers > 1
    if ray_train or train_config.num_gpus_per_worker > 0:  # a CPU rank in the driver's process reserves nothing
        out.append(
            (
                "a trainer rank",
                "train_config.num_cpus_per_worker / num_gpus_per_worker",
                _shape({"CPU": train_config.num_cpus_per_worker, "GPU": train_config.num_gpus_per_worker}),
            )
        )
    return out


def check_placement(cfg: Any, nodes: Sequence[Mapping[str, Any]], address: str | None = None) -> None:
    """Raise ``ConfigError`` when an actor of the run fits no single alive node (``ray.nodes()``)."""
    alive = [n for n in nodes if n.get("Alive", True)]
    problems = []
    for actor, keys, shape in actor_shapes(cfg):
        if not any(_fits(shape, n.get("Resources") or {}) for n in alive):
            where = f"the Ray cluster at {address}" if address else "this Ray cluster"
            problems.append(
                f"{actor} needs {_show(shape)} on one node ({keys}), but no node of {where} has that; its nodes: "
                + "; ".join(_node_line(n) for n in alive)
                + ". A cluster-wide total that suffices does not help: an actor runs on one node. "
                "Fix: lower those per-worker resources (fractions are allowed) or add a node that large."
            )
    if problems:
        raise ConfigError("\n".join(problems))


class PendingWatch:
    """Names this job's actors and Ray Train worker groups that wait for a node past ``bound``.

    ``check()`` is cheap enough for the driver's one-second loop (it reads the GCS at most every
    ``interval`` seconds). It logs a warning once per pending actor whose resources some alive node
    has (they are taken: a node died and its actors wait for room) and raises ``RunFailedError`` for
    one that no alive node could hold.
    """

    def __init__(self, *, bound: float = PENDING_BOUND_S, interval: float = 5.0) -> None:
        import ray

        self.bound, self.interval = bound, interval
        self._job = ray.get_runtime_context().get_job_id()
        self._first_seen: dict[str, float] = {}
        self._warned: set[str] = set()
        self._next = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        try:
            pending, nodes = self._pending(), _alive_nodes()
        except Exception:  # noqa: BLE001 - the GCS's tables are a diagnosis, never a cause of failure
            log.debug("could not read the cluster's pending actors", exc_info=True)
            return
        seen = {key for key, _, _ in pending}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in seen}
        for key, what, shape in pending:
            since = self._first_seen.setdefault(key, now)
            if now - since < self.bound:
                continue
            if not any(_fits(shape, n.get("Resources") or {}) for n in nodes):
                raise RunFailedError(
                    f"{what} has waited {now - since:.0f}s for a node with {_show(shape)}, and no alive node of the "
                    f"Ray cluster has that (nodes: {'; '.join(_node_line(n) for n in nodes) or 'none'}), so the run "
                    "stops instead of waiting for progress_timeout. Fix: add such a node (or lower the actor's "
                    "resources), then continue with `mineonline run --resume RUN_DIR`."
                )
            if key not in self._warned:
                if _room_now(shape):
                    # A node has its resources free now: the actor waits for its process to start (a busy
                    # machine), not for room; saying "full" would send the user after a lost node.
                    continue
                self._warned.add(key)
                log.warning(
                    "%s has waited %.0fs for a node with %s: the nodes that could hold it are full "
                    "(a node was lost?); it starts when one has room",
                    what,
                    now - since,
                    _show(shape),
                )

    def _pending(self) -> list[tuple[str, str, dict[str, float]]]:
        import ray
        from ray.core.generated import gcs_pb2

        # The GCS's own actor records: ``ray._private.state.actors()`` leaves out the resources.
        accessor = ray._private.state.state._connect_and_get_accessor()
        out = []
        for state in ("PENDING_CREATION", "RESTARTING"):
            for raw in accessor.get_actor_table(None, state):
                actor = gcs_pb2.ActorTableData.FromString(raw)
                actor_id = actor.actor_id.hex()
                if not actor_id.endswith(self._job) or actor.class_name.endswith("RayTrainWorker"):
                    continue  # another job's; a rank is reported through its placement group below
                what = f"actor {actor.name or actor.class_name} ({state.lower().replace('_', ' ')})"
                out.append((actor_id, what, _shape(dict(actor.required_resources))))
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg.get("state") != "PENDING" or not pg_id.endswith(self._job):
                continue
            for index, bundle in (pg.get("bundles") or {}).items():
                shape = _shape({k: v for k, v in bundle.items() if k in ("CPU", "GPU")})
                out.append(
                    (
                        f"{pg_id}/{index}",
                        f"Ray Train rank {index} (placement group {pg.get('name') or pg_id[:8]})",
                        shape,
                    )
                )
        return out


def _room_now(shape: dict[str, float]) -> bool:
    """Whether some node has ``shape`` free at this moment (False when the GCS cannot say)."""
    import ray

    try:
        free = ray._private.state.state.available_resources_per_node().values()
    except Exception:  # noqa: BLE001 - a diagnosis only: without it the warning is said as before
        return False
    return any(_fits(shape, room) for room in free)


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]
