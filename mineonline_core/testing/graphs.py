"""Which autograd graphs are alive: the bytes each forward call's graph keeps saved for backward.

``GraphTracker`` numbers every forward call of a module (a forward pre-hook) and, through
``torch.autograd.graph.saved_tensors_hooks``, tags each tensor autograd saves for backward with the
call that was running. A saved tensor lives exactly as long as the graph that holds it, so the tags
still alive when a new call starts are the graphs some caller still keeps. Bytes are counted per saved
tensor (a tensor saved twice counts twice): a measure of what graphs hold, not of allocator memory,
which the CPU allocator does not report.
"""

from __future__ import annotations

import weakref
from collections import Counter
from types import TracebackType
from typing import Any

import torch
from torch import nn


class _Saved:
    """What autograd keeps in place of a saved tensor: the tensor and the call that saved it."""

    __slots__ = ("tensor", "call", "__weakref__")

    def __init__(self, tensor: torch.Tensor, call: int) -> None:
        self.tensor, self.call = tensor, call


class GraphTracker:
    """``with GraphTracker(module) as t:`` then ``t.peak_bytes``, ``t.call_bytes``, ``t.max_calls_alive``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.call = 0  # the forward call running now (0: none yet)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.call_bytes: Counter[int] = Counter()  # bytes each call saved, alive or not
        self.alive: Counter[int] = Counter()  # saved tensors still alive, per call
        self.max_calls_alive = 0  # the most calls whose graphs were alive at once
        self._hooks: Any = None
        self._handle: Any = None

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.call += 1
        self._note()

    def _note(self) -> None:
        calls = sum(1 for c, n in self.alive.items() if n > 0) + (0 if self.alive[self.call] else 1)
        self.max_calls_alive = max(self.max_calls_alive, calls)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        size = tensor.numel() * tensor.element_size()
        # Detached: an output saved for its own backward would otherwise hold its graph in a cycle.
        saved = _Saved(tensor.detach(), self.call)
        self.alive[self.call] += 1
        self.call_bytes[self.call] += size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._note()
        weakref.finalize(saved, self._release, self.call, size)
        return saved

    def _release(self, call: int, size: int) -> None:
        self.alive[call] -= 1
        self.live_bytes -= size

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    @property
    def window_bytes(self) -> int:
        """The largest graph one forward call kept: one window's activations."""
        return max(self.call_bytes.values(), default=0)

    def __enter__(self) -> GraphTracker:
        self._handle = self.module.register_forward_pre_hook(self._pre_forward)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._hooks.__exit__(kind, exc, tb)
        self._handle.remove()
