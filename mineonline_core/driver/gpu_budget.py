"""How much GPU memory a run needs on the card of a trainer rank, estimated before Ray starts.

Counted for the trainer process on its GPU (``train_config.num_gpus_per_worker > 0``), from the policy
built on the ``meta`` device (shapes only, nothing allocated):

* the weights, their gradients, AdamW's two moments (each the parameters' own dtype, float32 as built),
  the KL reference when the trainer keeps one, and the broadcast snapshot (``trainer/publish.py`` keeps
  a copy of the weights on the device for each broadcast);
* the iteration's batch and the ``prefetch_batches`` batches fetched ahead while it trains (``assemble_chunks``
  puts every chunk of an iteration on the device, the prefetch thread too: ``trainer/fetch.py``);
* one window's activations: ``batch_size_per_gpu`` chunks of ``context_length`` steps. They are
  measured by running the meta policy over one chunk's window with ``saved_tensors_hooks`` counting the
  storages autograd saves for backward (the activations a window keeps until its backward), halved under
  ``use_amp`` (bfloat16 and float16 store them in 2 bytes at least). The estimate pass and the update each
  hold one window at a time and never at once, so one window is counted, not two. For VPT-2x on an H200
  the trainer allocated 1.3x this count in float32 and 1.9x under bfloat16 autocast (which saves the
  bfloat16 copies beside float32 tensors that other ops keep): backward's transients and autocast are
  what a lower bound leaves out;
* a CUDA context per process (kernels and cuBLAS/cuDNN workspaces, measured 0.4-0.6 GiB);
* the rollout inference Ray may place on the same card (``rollout_config.num_gpus_per_worker`` fractions
  that fit beside the trainer's): the shared inference server (``inference: shared``) holds the weights,
  the reference and every env's recurrent states once; with ``local`` inference each worker holds its
  own copies and its envs' states, in a CUDA context of its own.

Allocator fragmentation and the inference forwards' transient tensors are not counted: like the host
estimate (``budget.py``) this is a lower bound, so a config refused here cannot fit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any
from unittest import mock

from mineonline_core.errors import ConfigError

GiB = 2**30
CUDA_CONTEXT_BYTES = 400 * 2**20  # measured 0.4-0.6 GiB per process with torch's CUDA kernels loaded
AMP_ACTIVATION_FACTOR = 0.5  # bfloat16 / float16 activations: 2 bytes instead of 4


def gpu_memory() -> tuple[int, str] | None:
    """Bytes of the smallest GPU this process sees and its name, or None without a CUDA device."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    cards = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    smallest = min(cards, key=lambda p: p.total_memory)
    return int(smallest.total_memory), smallest.name


def _meta_input(space: Any, batch: int, steps: int) -> Any:
    import numpy as np
    import torch

    spaces = getattr(space, "spaces", None)
    if isinstance(spaces, dict):
        return {k: _meta_input(s, batch, steps) for k, s in spaces.items()}
    dtype = torch.from_numpy(np.empty(0, dtype=space.dtype)).dtype
    return torch.empty((batch, steps, *space.shape), dtype=dtype, device="meta")


def _no_meta_autocast(real: Any) -> Any:
    # torch.autocast refuses the meta device type; a policy's own autocast blocks change dtypes on a GPU
    # but not shapes, so on meta they are no-ops.
    def autocast(device_type: str, *args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)

    return autocast


def window_activation_bytes(policy: Any, observation_space: Any, steps: int) -> int | None:
    """Bytes autograd saves for backward over one chunk's window of ``steps`` steps, in float32, measured
    on the meta device (each storage once, the policy's weights not); None when the policy cannot run there."""
    import torch

    saved = [0]
    # Storages, by identity: a tensor that several ops save (or views of it) is held once, and the weights
    # autograd saves are the policy's own, counted once beside the batch, not once per chunk of it. Counting
    # each saved tensor gave VPT-2x 96 MiB a frame, above the ~80 its trainer allocated on an H200.
    counted = {t.untyped_storage()._cdata for t in (*policy.parameters(), *policy.buffers())}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in counted:
            counted.add(storage._cdata)
            saved[0] += storage.nbytes()
        return tensor

    try:
        with torch.device("meta"):
            state = policy.initial_state(1) if hasattr(policy, "initial_state") else None
        first = torch.zeros((1, steps), dtype=torch.bool, device="meta")
        with (
            mock.patch.object(torch, "autocast", _no_meta_autocast(torch.autocast)),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            policy(input=_meta_input(observation_space, 1, steps), state_in=state, context={"first": first})
    except Exception:  # noqa: BLE001 - a forward the meta device cannot run: activations unknown here
        return None
    return saved[0]


@dataclasses.dataclass
class GpuEstimate:
    """Bytes each part needs on the card of a trainer rank."""

    parts: dict[str, int]
    activations_known: bool
    frame_bytes: int  # activation bytes per trained frame at the configured precision (0: unknown)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return f"about {self.total / GiB:.1f} GiB: " + "; ".join(
            f"{k} {v / GiB:.1f} GiB" for k, v in self.parts.items()
        )

    def check(self, card: tuple[int, str] | None = None) -> None:
        """Refuse a run whose trainer card's estimate exceeds the card's memory (``gpu_memory()`` by default)."""
        card = card if card is not None else gpu_memory()
        if card is None or self.total <= card[0]:
            return
        size, name = card
        per_frame = f" ({self.frame_bytes / 2**20:.0f} MiB a trained frame)" if self.frame_bytes else ""
        raise ConfigError(
            f"The trainer's GPU needs {self.describe()}{per_frame}, but a GPU here ({name}) has "
            f"{size / GiB:.1f} GiB. Fix: lower train_config.batch_size_per_gpu or context_length (one window's "
            "activations grow with both), set train_config.use_amp: true (bfloat16 halves them), give the trainer "
            "a whole GPU (train_config.num_gpus_per_worker: 1, fewer rollout workers beside it through "
            "rollout_config.num_gpus_per_worker), or shrink the policy."
        )


def estimate_gpu(
    cfg: Any,
    policy: Any,
    *,
    policy_bytes: int,
    state_bytes: int,
    step_bytes: int,
    observation_space: Any,
    reference: bool,
) -> GpuEstimate | None:
    """The trainer card's estimate, or None when training does not run on a GPU."""
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    if train_config.num_gpus_per_worker <= 0:
        return None
    from mineonline_core.config.precision import PrecisionChoice

    amp = PrecisionChoice.from_config(train_config).use_amp
    window = (
        window_activation_bytes(policy, observation_space, train_config.context_length) if policy is not None else None
    )
    frame_bytes = 0
    if window is not None:
        frame_bytes = int(window * (AMP_ACTIVATION_FACTOR if amp else 1.0)) // train_config.context_length
    chunks = train_config.batches_per_iteration * train_config.batch_size_per_gpu
    steps = rollout_config.replay_buffer_config.fragments_per_chunk * rollout_config.fragment_length
    batches = (1 + train_config.prefetch_batches) * chunks * steps * step_bytes  # one training, the rest fetched ahead
    parts = {
        "weights, gradients and AdamW's two moments": 4 * policy_bytes,
        "KL reference": policy_bytes if reference else 0,
        "broadcast snapshot": policy_bytes,
        f"the iteration's batch and {train_config.prefetch_batches} prefetched": batches,
        f"one window's activations ({train_config.batch_size_per_gpu} x {train_config.context_length} steps"
        f"{', use_amp' if amp else ', float32'})": train_config.batch_size_per_gpu
        * train_config.context_length
        * frame_bytes,
        "CUDA context": CUDA_CONTEXT_BYTES,
    }
    copies = 2 if reference else 1  # the policy, and the reference beside it
    if rollout_config.num_gpus_per_worker > 0 and train_config.num_gpus_per_worker < 1:
        room = 1 - train_config.num_gpus_per_worker + 1e-9
        if getattr(rollout_config, "inference", "local") == "shared":
            # One server process holds the weights and every env's recurrent states for all workers.
            share = min(1.0, rollout_config.num_rollout_workers * rollout_config.num_gpus_per_worker)
            if share <= room:
                envs = rollout_config.num_rollout_workers * rollout_config.worker_config.num_envs
                parts["the shared inference server on the same GPU"] = (
                    CUDA_CONTEXT_BYTES + copies * policy_bytes + envs * copies * state_bytes
                )
        else:
            beside = min(rollout_config.num_rollout_workers, math.floor(room / rollout_config.num_gpus_per_worker))
            per_worker = (
                CUDA_CONTEXT_BYTES
                + copies * policy_bytes
                + rollout_config.worker_config.num_envs * copies * state_bytes
            )
            if beside:
                parts[f"{beside} rollout workers on the same GPU"] = beside * per_worker
    return GpuEstimate(
        parts={k: v for k, v in parts.items() if v}, activations_known=window is not None, frame_bytes=frame_bytes
    )
