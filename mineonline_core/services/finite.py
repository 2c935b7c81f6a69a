"""Finite values everywhere: where a NaN or an infinity is caught, and what happens then.

* **Env answers** (the env pool, ``env_answer_problem``): a non-finite reward, observation or final
  observation makes the env count as failed for that step: the step is closed as truncated, the
  episode reported, the env reset, and ``rollout/env_nonfinite`` counts it. Nothing non-finite is
  ever written into a fragment.
* **Optimiser steps** (``UpdateGuard``): a non-finite loss term or gradient norm skips the update
  (``trainer/skipped_updates``); ``max_consecutive`` skips in a row stop the run with an error that
  names the loss terms and parameters that went non-finite.
* **Weights** (``require_finite``): never broadcast to the rollout workers nor checkpointed unless
  every floating-point value is finite. Tensors are checked where they live, by their sums (which a
  NaN or an infinity always makes non-finite) and one device sync (``surely_finite``); only a
  failed check scans every value, to name the parameters (or to find that a sum only overflowed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from mineonline_core.errors import RunFailedError

log = logging.getLogger(__name__)


def _nonfinite_count(leaf: Any) -> int:
    if isinstance(leaf, torch.Tensor):
        if not (leaf.is_floating_point() or leaf.is_complex()):
            return 0
        return int((~torch.isfinite(leaf)).sum())
    arr = np.asarray(leaf)
    if arr.dtype.kind not in "fc":
        return 0  # integers, booleans and strings cannot be NaN
    return int(arr.size - np.count_nonzero(np.isfinite(arr)))


def _size(leaf: Any) -> int:
    return int(leaf.numel()) if isinstance(leaf, torch.Tensor) else int(np.size(leaf))


def nonfinite_leaves(tree: Any, prefix: str = "") -> list[tuple[str, int, int]]:
    """``(path, non-finite count, size)`` of every leaf of ``tree`` holding a NaN or an infinity.

    Paths read like the config: ``obs.rgb``, ``state[0]``."""
    if isinstance(tree, Mapping):
        return [
            hit
            for key, value in tree.items()
            for hit in nonfinite_leaves(value, f"{prefix}.{key}" if prefix else str(key))
        ]
    if isinstance(tree, (list, tuple)):
        return [hit for i, value in enumerate(tree) for hit in nonfinite_leaves(value, f"{prefix}[{i}]")]
    if tree is None:
        return []
    bad = _nonfinite_count(tree)
    return [(prefix or "value", bad, _size(tree))] if bad else []


def describe(hits: Iterable[tuple[str, int, int]], limit: int = 5) -> str:
    hits = list(hits)
    text = ", ".join(f"{path!r} ({bad} of {size} values)" for path, bad, size in hits[:limit])
    return text + (f" and {len(hits) - limit} more" if len(hits) > limit else "")


def env_answer_problem(reward: float | None, obs: Any, final_obs: Any) -> str | None:
    """What is non-finite in an env's answer (naming the key), or None when all of it is finite."""
    problems = []
    if reward is not None and not math.isfinite(reward):
        problems.append(f"reward is {reward}")
    for what, tree in (("observation", obs), ("final observation", final_obs)):
        hits = nonfinite_leaves(tree)
        if hits:
            problems.append(f"{what} key {describe(hits)} non-finite")
    return "; ".join(problems) or None


def surely_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True only when every value of ``tensors`` is finite: one sum per tensor, stacked per (device,
    dtype), one sync. A NaN or an infinity always makes a sum non-finite; an overflow of finite
    values does too, so False means "maybe not": the caller then scans for the culprits."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point():
            # Summed in at least float32: an fp16 or bf16 sum of finite weights overflows (100k ones in fp16)
            wide = torch.promote_types(t.dtype, torch.float32)
            groups.setdefault((t.device, wide), []).append(t.detach().sum(dtype=wide))
        elif t.is_complex():
            groups.setdefault((t.device, t.dtype), []).append(t.detach().sum())
    flags = [torch.isfinite(torch.stack(sums)).all().cpu() for sums in groups.values()]
    return bool(torch.stack(flags).all()) if flags else True


def require_finite(state_dict: Mapping[str, Any], *, what: str) -> None:
    """Raise ``RunFailedError`` naming the parameters when any weight is NaN or infinite."""
    values = list(state_dict.values())
    if all(isinstance(v, torch.Tensor) for v in values) and surely_finite(values):
        return
    hits = [(name, bad, _size(value)) for name, value in state_dict.items() if (bad := _nonfinite_count(value))]
    if hits:
        raise RunFailedError(
            f"The model's weights hold non-finite values, so they are not {what}: {describe(hits)}. The last "
            f"checkpoint is intact; resume from it with a lower train_config.learning_rate or max_grad_norm, and "
            f"check the env's rewards and observations (rollout/env_nonfinite)."
        )


class UpdateGuard:
    """Decides whether an optimiser step may go ahead, counts skips and fails the run after
    ``max_consecutive`` skips in a row. One per trainer rank."""

    def __init__(self, *, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.skipped_total = 0
        self.skipped_iteration = 0  # reset by the trainer at the start of every iteration
        self.consecutive = 0

    def check(
        self,
        *,
        finite: bool,
        loss_terms: Mapping[str, float],
        named_grads: Iterable[tuple[str, Any]],
        grad_norm: float,
        where: str,
    ) -> bool:
        """``finite``: the decision (taken identically on every rank). True: step; False: skip."""
        if finite:
            self.consecutive = 0
            return True
        self.skipped_total += 1
        self.skipped_iteration += 1
        self.consecutive += 1
        bad_terms = [k for k, v in loss_terms.items() if not math.isfinite(float(v))]
        bad_grads = [(name, bad, _size(g)) for name, g in named_grads if g is not None and (bad := _nonfinite_count(g))]
        cause = "; ".join(
            filter(
                None,
                [
                    f"loss terms {', '.join(bad_terms)}" if bad_terms else "",
                    f"gradients of {describe(bad_grads)}" if bad_grads else "",
                    f"gradient norm {grad_norm}" if not bad_terms and not bad_grads else "",
                ],
            )
        )
        log.warning("%s: non-finite %s; optimiser step skipped (%d in a row)", where, cause, self.consecutive)
        if self.consecutive >= self.max_consecutive:
            raise RunFailedError(
                f"{where}: {self.consecutive} optimiser steps in a row had non-finite values (last: {cause}), so the "
                f"run stops (train_config.max_skipped_updates={self.max_consecutive}). The last checkpoint holds "
                f"finite weights. Fix: check the env's rewards and observations (rollout/env_nonfinite), lower "
                f"train_config.learning_rate, or raise max_skipped_updates if skips are expected."
            )
        return False
