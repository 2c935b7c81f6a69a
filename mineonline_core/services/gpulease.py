"""``GpuLease``: a GPU share booked in Ray for the trainer rank that runs in the driver's process.

The driver is not a Ray actor, so a rank in it reserves nothing; this actor, with the rank's
``num_gpus`` and no CPU, pinned to the driver's node, books the share for as long as it lives (so
rollout workers are never placed on it) and says which GPU Ray gave it. It keeps no other state,
and, like every bookkeeping actor, never imports torch (``trainer/device.py`` maps the GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray

from mineonline_core.services.names import on_node

if TYPE_CHECKING:
    from ray.actor import ActorHandle

LEASE_WAIT_S = 60.0  # an actor start takes a second or two; longer means no free GPU share on this node


@ray.remote(num_cpus=0)
class GpuLease:
    """Holds a GPU share in Ray's books for the trainer in the driver's process; does nothing else."""

    def gpu_ids(self) -> list[str]:
        return [str(gpu) for gpu in ray.get_gpu_ids()]


def lease_gpu(num_gpus: float, *, timeout: float = LEASE_WAIT_S) -> tuple[ActorHandle | None, list[str]]:
    """A ``GpuLease`` of ``num_gpus`` on this node and its GPU ids, or ``(None, [])`` when Ray does
    not grant it within ``timeout`` seconds. The caller ends the lease with ``ray.kill``."""
    lease = GpuLease.options(num_gpus=num_gpus, scheduling_strategy=on_node()).remote()
    ready, _ = ray.wait([lease.gpu_ids.remote()], timeout=timeout)
    if not ready:
        ray.kill(lease)
        return None, []
    return lease, ray.get(ready[0])
