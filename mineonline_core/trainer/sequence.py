"""Running a policy over whole chunks (N, L) in windows of ``context_length`` steps.

A chunk is trained as one sequence that starts from its first fragment's ``state_in``. It is cut
into windows of ``context_length`` steps; the recurrent state is carried from one window to the next
and detached there (truncated back-propagation through time), which bounds memory. The policy
itself resets its memory wherever ``first`` is set, at any step of any window, so this forward
reproduces the rollout's step-by-step outputs for the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.tree import tree_cat, tree_map


def unwrap(model: nn.Module) -> nn.Module:
    """The policy inside a DistributedDataParallel (or similar) wrapper."""
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def windows(length: int, context_length: int) -> list[slice]:
    """Consecutive time slices of at most ``context_length`` steps covering ``range(length)``."""
    return [slice(start, min(start + context_length, length)) for start in range(0, length, context_length)]


def detach_state(state: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, state)


def slice_time(tree: Any, window: slice) -> Any:
    """Select a time window from every (N, L, ...) leaf."""
    return tree_map(lambda x: x[:, window], tree)


def iter_windows(
    model: nn.Module, obs: Any, state_in: Any, first: torch.Tensor, *, context_length: int
) -> Iterator[tuple[slice, dict, Any]]:
    """Yield ``(window, latents, state_out)`` for each window; the caller may backward each one.

    The state carried into the next window is detached, so a window's graph is freed as soon as the
    caller is done with it.
    """
    state = state_in
    for window in windows(first.shape[1], context_length):
        latents, state_out = model(input=slice_time(obs, window), state_in=state, context={"first": first[:, window]})
        yield window, latents, state_out
        state = detach_state(state_out)


def forward_sequence(
    policy: nn.Module, obs: Any, state_in: Any, first: torch.Tensor, *, context_length: int
) -> tuple[dict, Any]:
    """Latents for the whole (N, L) sequence and the final state, window by window.

    Gradients flow within each window if enabled by the caller; use ``torch.no_grad()`` for
    evaluation. ``vpred`` comes back as (N, L) (a trailing singleton axis is dropped).
    """
    pieces, state = [], state_in
    for _, latents, state in iter_windows(policy, obs, state_in, first, context_length=context_length):
        pieces.append(latents)
    out = {key: tree_cat([piece[key] for piece in pieces], axis=1) for key in pieces[0]}
    out[Outputs.VPRED] = squeeze_value(out[Outputs.VPRED])
    return out, state


def squeeze_value(vpred: torch.Tensor) -> torch.Tensor:
    return vpred[..., 0] if vpred.dim() == 3 else vpred
