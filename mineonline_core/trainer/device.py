"""The device of a single trainer rank in the driver's process: the CPU, or the GPU Ray leases it.

One rank trains in the driver's process (``DriverSide.fit``), a GPU rank too: no Ray Train
controller, worker group or NCCL group for a world of one. The driver is not a Ray actor, so Ray has
reserved nothing for it and set no ``CUDA_VISIBLE_DEVICES``. A GPU rank therefore first leases its
share: a ``GpuLease`` actor (``services/gpulease.py``) with ``train_config.num_gpus_per_worker`` GPUs
and no CPU, pinned to the driver's node, holds the share until training ends, so that rollout
workers' ``num_gpus_per_worker`` are never booked onto it, and reports which GPU Ray gave it;
``rank_device`` maps that GPU to this process's CUDA device. Ray Train runs the rank instead, with a
log line saying why, when this process sees no CUDA device, the lease is not granted within
``LEASE_WAIT_S`` (no free share on the driver's node), or the leased GPU is not one of this
process's CUDA devices. As for a CPU rank, the driver's CPU threads are not reserved in Ray
(``num_cpus_per_worker`` sets torch's thread count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rank_device(
    *, gpu_ids: Sequence[str], visible_devices: str | None, device_count: int
) -> tuple[torch.device | None, str]:
    """This process's CUDA device for the first of ``gpu_ids`` (Ray's names of the leased GPUs on
    this node), or None and why not. ``visible_devices``: this process's ``CUDA_VISIBLE_DEVICES``
    (None when unset, so that device ``i`` is GPU ``i``); ``device_count``: the CUDA devices it sees."""
    if device_count == 0:
        return None, f"the driver's process sees no CUDA device (CUDA_VISIBLE_DEVICES={visible_devices!r})"
    if not gpu_ids:
        return None, "Ray granted the driver no GPU share on its node"
    if visible_devices is None:
        names = [str(i) for i in range(device_count)]
    else:
        names = [name.strip() for name in visible_devices.split(",")][:device_count]
    gpu = str(gpu_ids[0])
    if gpu not in names:
        return (
            None,
            f"Ray's GPU {gpu} is not one of the driver's CUDA devices (CUDA_VISIBLE_DEVICES={visible_devices!r})",
        )
    return torch.device("cuda", names.index(gpu)), f"Ray's GPU {gpu}"


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with an index: a bare ``"cuda"`` becomes this process's current CUDA device.

    ``torch.cuda.set_device`` refuses a device without an index, and two tensors on ``cuda`` and
    ``cuda:0`` compare as different devices; the trainer picks its device through this helper so that
    what it stores, sets and moves tensors to is always one concrete GPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def fused_adamw(params: list[torch.Tensor]) -> bool | None:
    """True when every parameter is a CUDA float: AdamW's fused kernel steps them all in a few launches
    (and takes the GradScaler's inf check on the device). None (torch's default) elsewhere."""
    return True if params and all(p.is_cuda and p.is_floating_point() for p in params) else None
