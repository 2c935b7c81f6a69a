"""Shared fixtures (``mineonline_core.testing.fixtures``: ``plugin_manager``, ``local_ray``) and the CartPole
configs most tests start from.

``cartpole_config`` is a CartPole run with an MLP policy and no logger; ``small_cartpole_run`` adds the small,
fast run the end-to-end tests train. A test passes what matters to it as keywords, so the call shows it:
``small_cartpole_run(run_name="safe", train_config={"num_iterations": 2})``. Import them as
``from tests.conftest import cartpole_config``.
"""

from __future__ import annotations

import copy
from typing import Any

pytest_plugins = ["mineonline_core.testing.fixtures"]

_CARTPOLE: dict[str, Any] = {
    "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
}
# One rollout worker of two envs and one trainer rank, half a CPU each (both fit a 2-CPU local Ray
# with the bookkeeping actors); 32-step fragments, one a chunk, in the memory store; an iteration
# trains on 2 batches of 2 chunks, 16 steps of context; no video.
_SMALL_RUN: dict[str, Any] = {
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 32,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {"fragments_per_chunk": 1, "database_config": {"backend": "memory"}},
    },
    "train_config": {
        "num_workers": 1,
        "num_cpus_per_worker": 0.5,
        "vf_warmup": 0,
        "batch_size_per_gpu": 2,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "context_length": 16,
        "record_video_interval": 0,
    },
}


def merged(base: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``keys`` over it; a dict over a dict is merged key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in keys.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def cartpole_config(**keys: Any) -> dict[str, Any]:
    """A run on ``CartPole-v1`` (the ``gymnasium`` env) with the ``mlp`` policy and no logger, ``keys`` over it."""
    return merged(_CARTPOLE, keys)


def small_cartpole_run(**keys: Any) -> dict[str, Any]:
    """``cartpole_config`` with the small run described above, ``keys`` over it."""
    return merged(merged(_CARTPOLE, _SMALL_RUN), keys)
