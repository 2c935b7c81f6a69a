"""The trainer's copy of its weights for one broadcast (``publish.py``), in buffers allocated once.

On a CUDA rank a version leaves in three steps, none of which makes the training thread or stream
wait for the host:

1. ``copy_from`` (training thread, training stream): one device-to-device copy per tensor into flat
   device buffers, one per dtype. The next optimiser step cannot change what is sent, and the finite
   check reads one sum per buffer.
2. ``start_host_copy`` (training thread): an event recorded on the training stream after that copy; a
   side stream waits for it and copies each device buffer to its pinned host buffer (``non_blocking``),
   then records ``copied``. Training goes on while the copy engine works.
3. ``host`` (broadcast thread): waits for ``copied`` (that thread alone) and wraps the pinned buffers
   as ``PackedWeights`` for ``ray.put``.

Every buffer is reused by every version and re-allocated only when the state dict's keys, shapes or
dtypes change. Reuse is safe because the publisher lets one broadcast be in flight at most: it waits
for the previous one (its ``ray.put`` included) before the next ``copy_from``, so neither the pinned
buffers ``ray.put`` reads nor the device buffers the side stream reads are overwritten early. One
broadcast takes far less than an iteration, so that wait is empty in practice; a second set of pinned
buffers would pin another model's size of host memory to save it. The training stream also waits (on
the GPU) for the previous ``copied`` before overwriting the device buffers.

On a CPU rank the "device" buffers are host memory: ``copy_from`` is the only copy, ``host`` wraps
them as they are, and nothing is pinned (pinning needs CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mineonline_core.services import weights as W


class WeightSnapshot:
    """A state dict's copy for the broadcast (see the module doc). ``staged``: through pinned host
    buffers on a side stream; by default, when the state dict lives on a CUDA device."""

    def __init__(self, state: Mapping[str, torch.Tensor], *, staged: bool | None = None) -> None:
        self.layout = [(k, v.shape, v.dtype, v.device) for k, v in state.items()]
        groups, self.places = W.layout(state)
        self.staged = any(device.type == "cuda" for device, _, _ in groups) if staged is None else staged
        self.flats = [torch.empty(n, dtype=dtype, device=device) for device, dtype, n in groups]
        self.views = W.views(self.flats, self.places)
        self._hosts = [W.host_buffer(n, dtype, pinned=True) for _, dtype, n in groups] if self.staged else self.flats
        self._stream: Any = None
        self._copied: Any = None  # the event after the last host copy (staged)

    def holds(self, state: Mapping[str, torch.Tensor]) -> bool:
        return self.layout == [(k, v.shape, v.dtype, v.device) for k, v in state.items()]

    def copy_from(self, state: Mapping[str, torch.Tensor]) -> WeightSnapshot:
        """Training thread: copy ``state`` into the snapshot's buffers (step 1)."""
        if self._copied is not None:  # the side stream may still read the device buffers
            torch.cuda.current_stream(self._device()).wait_event(self._copied)
        with torch.no_grad():
            torch._foreach_copy_(list(self.views.values()), [v.detach() for v in state.values()])
        return self

    def start_host_copy(self) -> None:
        """Training thread: start the copy to the pinned host buffers (step 2; nothing on a CPU rank)."""
        if not self.staged:
            return
        device = self._device()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(device))
        self._stream.wait_event(written)
        copied = torch.cuda.Event(blocking=True)  # ``host`` sleeps in its wait instead of spinning a core
        with torch.cuda.stream(self._stream):
            for host, flat in zip(self._hosts, self.flats):
                host.copy_(flat, non_blocking=True)
            copied.record(self._stream)
        self._copied = copied

    def host(self) -> W.PackedWeights:
        """Broadcast thread: the weights in host memory, packed for ``ray.put`` (step 3)."""
        if self._copied is not None:
            self._copied.synchronize()
        return W.PackedWeights.of(self._hosts, self.places)

    def _device(self) -> torch.device:
        return self.flats[0].device if self.flats else torch.device("cpu")
