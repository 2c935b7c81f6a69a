"""Nested structures of arrays or tensors: observations, actions and recurrent states.

A tree is a dict, list or tuple of trees, or a leaf (array, tensor, number, None). Recurrent states
of any policy, dict observations and dict actions all go through these few functions, so the rollout
and the trainer never need to know a policy's state layout.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import torch


def _is_tensor(x: Any) -> bool:
    # torch is imported lazily: the bookkeeping actors (buffer, store host, logging) handle only
    # numpy trees and must not pay torch's import at start-up. Without torch loaded, no leaf is a tensor.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` to each leaf (with the matching leaves of ``rest``); None stays None."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if isinstance(tree, (list, tuple)):
        mapped = [tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree)]
        return tuple(mapped) if isinstance(tree, tuple) else mapped
    if tree is None:
        return None
    return fn(tree, *rest)


def tree_leaves(tree: Any) -> list[Any]:
    """Leaves in a deterministic order (dict keys in insertion order), None excluded."""
    out: list[Any] = []
    tree_map(lambda x: out.append(x), tree)
    return out


def tree_stack(trees: list[Any], axis: int = 0) -> Any:
    """Stack matching trees along a new axis (numpy arrays or tensors)."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: tree_stack([t[k] for t in trees], axis) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(tree_stack([t[i] for t in trees], axis) for i in range(len(first)))
    if first is None:
        return None
    if _is_tensor(first):
        import torch

        return torch.stack(trees, axis)
    return np.stack([np.asarray(t) for t in trees], axis)


def tree_cat(trees: list[Any], axis: int = 0) -> Any:
    """Concatenate matching trees along an existing axis."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: tree_cat([t[k] for t in trees], axis) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(tree_cat([t[i] for t in trees], axis) for i in range(len(first)))
    if first is None:
        return None
    if _is_tensor(first):
        import torch

        return torch.cat(trees, axis)
    return np.concatenate(trees, axis)


def tree_index(tree: Any, index: Any) -> Any:
    """Index every leaf with the same index (batch selection)."""
    return tree_map(lambda x: x[index], tree)


def to_torch(tree: Any, device: torch.device | str = "cpu") -> Any:
    """Numpy leaves to tensors on ``device`` without copying when already there."""
    import torch

    return tree_map(lambda x: torch.as_tensor(x).to(device, non_blocking=True), tree)


def to_numpy(tree: Any) -> Any:
    """Tensor leaves to numpy (detached, on CPU)."""
    return tree_map(lambda x: x.detach().cpu().numpy() if _is_tensor(x) else np.asarray(x), tree)
