"""The Ray names of a run's actors, built here and nowhere else, and the node its bookkeeping actors are pinned to.

Every actor of a run lives in the namespace ``mineonline`` under ``{run_name}/{role}``, so that
``mineonline status`` and ``mineonline stop`` (a second driver) can find a run's actors by name,
and two runs on one cluster never collide.
"""

from __future__ import annotations

from typing import Any

NAMESPACE = "mineonline"

ROLLOUT_MANAGER = "rollout_manager"
LOGGER_HUB = "logger_hub"
REPLAY_BUFFER = "replay_buffer"
EPISODE_STATISTICS = "episode_statistics"
STORE_HOST = "store_host"
ROLLOUT_WORKER = "rollout_worker"
INFERENCE_SERVER = "inference_server"
EVALUATOR = "evaluator"


def actor_name(run_name: str, role: str, index: int | None = None) -> str:
    """``{run_name}/{role}``, or ``{run_name}/{role}_{index}`` for one of several (rollout workers)."""
    return f"{run_name}/{role}" if index is None else f"{run_name}/{role}_{index}"


def split_name(name: str) -> tuple[str, str] | None:
    """``(run_name, role)`` of an actor name built by ``actor_name``; None for any other actor's name."""
    run, sep, role = name.rpartition("/")
    return (run, role) if sep and run and role else None


def on_node(node_id: str | None = None) -> Any:
    """The scheduling strategy of a bookkeeping actor or task: ``node_id`` (default: this process's
    node), hard affinity: it runs there or not at all."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id or ray.get_runtime_context().get_node_id(), soft=False)
