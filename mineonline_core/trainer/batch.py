"""From fetched fragment payloads to a training batch: chunk assembly and advantage estimation.

Each chunk's fragments are concatenated along time into one sequence of
``L = fragments_per_chunk * fragment_length`` steps; the chunks are stacked into (N, L, ...) tensors.
The recurrent state before the sequence is the first fragment's ``state_in`` (batch size 1 each,
concatenated along the batch axis), so a chunk trains as one sequence from where rollout started it.

The estimate pass (``current_policy_outputs``) runs the current model over the batch as the update's
first step will run it, micro-batch by micro-batch, window by window, in the training numerics:
memory is bounded by the micro-batch, and the log-probs it records are the update's proximal policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.tree import to_torch, tree_cat, tree_index, tree_map, tree_stack
from mineonline_core.trainer.gae import compute_gae
from mineonline_core.trainer.sequence import detach_state, slice_time, squeeze_value, unwrap, windows


def assemble_chunks(chunks: list[list[dict]], *, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Stack chunks (each a list of consecutive fragments of one stream) into a (N, L) batch. An optional
    column (``ref_logits``) is in the batch only when every fragment has it: the update falls back to running
    the reference for a batch without it (a store written before the column, or a fragment the reference joined
    mid-way)."""
    optional = [c for c in F.OPTIONAL_STEP_COLUMNS if all(f.get(c) is not None for fs in chunks for f in fs)]
    sequences = []
    for fragments in chunks:
        seq = {c: tree_cat([f[c] for f in fragments], axis=0) for c in (*F.STEP_COLUMNS, *optional)}
        seq[F.NEXT_OBS] = fragments[-1][F.NEXT_OBS]
        seq[F.STATE_IN] = fragments[0][F.STATE_IN]
        seq[F.REF_STATE_IN] = fragments[0].get(F.REF_STATE_IN)
        sequences.append(seq)
    batch = {c: tree_stack([s[c] for s in sequences], axis=0) for c in (*F.STEP_COLUMNS, *optional)}
    # Each fragment's next_obs leaves are (1, ...): stacked they are (N, 1, ...), one time step.
    batch[F.NEXT_OBS] = tree_stack([s[F.NEXT_OBS] for s in sequences], axis=0)
    for column in (F.STATE_IN, F.REF_STATE_IN):
        states = [s[column] for s in sequences]
        batch[column] = (
            None if any(s is None for s in states) else tree_cat([tree_map(np.asarray, s) for s in states], axis=0)
        )
    return to_torch(batch, device)


def denormalized_value(policy: nn.Module, vpred: torch.Tensor) -> torch.Tensor:
    head = getattr(unwrap(policy), "value_head", None)
    return head.denormalize(vpred) if head is not None and hasattr(head, "denormalize") else vpred


@torch.no_grad()
def current_policy_outputs(
    policy: nn.Module,
    batch: dict[str, Any],
    *,
    context_length: int,
    batch_size: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, torch.Tensor]:
    """The *current* model over each whole chunk from its stored ``state_in``, keeping no
    gradients, run as the update's first step runs it: ``batch_size`` chunks at a time (the micro-batch, so
    memory is bounded by it, not by the iteration), in ``context_length`` windows, under
    ``autocast`` (the training numerics) and in the mode the update trains it in (the core never
    switches the model to ``eval``). Its log-probs are then the first update step's own: the
    proximal policy of PPO's decoupled objective, which precision can never make off-policy.

    Returns, float32: ``logprob`` of the stored actions (N, L), ``vpred`` (N, L), the value head's
    own (normalised) output, ``value`` (N, L) and ``next_value`` (N,) denormalised: the value of
    ``next_obs`` after the last step (its ``first`` flag is set when the last step ended an
    episode, though a bootstrap ignores it then).
    """
    policy = unwrap(policy)
    n = batch[F.REWARD].shape[0]
    step = batch_size or n
    parts = [
        _slice_outputs(policy, batch, slice(start, start + step), context_length=context_length, autocast=autocast)
        for start in range(0, n, step)
    ]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def _slice_outputs(
    policy: nn.Module,
    batch: dict[str, Any],
    rows: slice,
    *,
    context_length: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> dict[str, torch.Tensor]:
    obs, state_in, first = (tree_index(batch[c], rows) for c in (F.OBS, F.STATE_IN, F.FIRST))
    # Gradients recorded as in the update, because some kernels compute otherwise without them (VPT's
    # attention in bf16 on CPU differs by 1e-4 in log-prob). So each window's graph (its activations)
    # must be gone before the next window runs: only detached outputs and state leave the window, and
    # its own references are dropped (a generator's or loop's locals would keep the last one alive).
    pieces, state = [], state_in
    with torch.enable_grad(), autocast():
        for window in windows(first.shape[1], context_length):
            latents, state_out = policy(
                input=slice_time(obs, window), state_in=state, context={"first": first[:, window]}
            )
            pieces.append(
                detach_state(
                    {
                        Outputs.PI_LOGITS: latents[Outputs.PI_LOGITS],
                        Outputs.VPRED: squeeze_value(latents[Outputs.VPRED]),
                    }
                )
            )
            state = detach_state(state_out)
            del latents, state_out
        done_last = (batch[F.TERMINATED][rows, -1:] | batch[F.TRUNCATED][rows, -1:]).bool()
        next_obs = tree_index(batch[F.NEXT_OBS], rows)
        next_vpred = squeeze_value(
            policy(input=next_obs, state_in=state, context={"first": done_last})[0][Outputs.VPRED]
        )
        next_vpred = next_vpred.detach().float()[:, 0]
    latents = {key: tree_cat([piece[key] for piece in pieces], axis=1) for key in pieces[0]}
    # Scored as the update scores them: float32 logits, outside autocast.
    logits = tree_map(lambda x: x.float(), latents[Outputs.PI_LOGITS])
    vpred = latents[Outputs.VPRED].float()
    return {
        "logprob": policy.pi_head.logprob(tree_index(batch[F.ACTION], rows), logits).float(),
        "vpred": vpred,
        "value": denormalized_value(policy, vpred).float(),
        "next_value": denormalized_value(policy, next_vpred).float(),
    }


@torch.no_grad()
def estimate_advantages(
    policy: nn.Module,
    batch: dict[str, Any],
    *,
    version: int,
    context_length: int,
    discount: float,
    gae_lambda: float,
    batch_size: int | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict[str, Any]:
    """Add ``value``, ``advantage``, ``return``, ``staleness``, ``logprob_prox`` (the proximal
    log-prob of the stored actions) and ``old_vpred`` (the value head's output, the centre of a
    clipped value loss) to ``batch``, all (N, L) float32: GAE over the current model's values, from
    one pass of ``current_policy_outputs`` (``batch_size`` and ``autocast`` as there)."""
    current = current_policy_outputs(
        policy, batch, context_length=context_length, batch_size=batch_size, autocast=autocast
    )
    value = current["value"]
    advantage, returns = compute_gae(
        reward=batch[F.REWARD],
        value=value,
        next_value=current["next_value"],
        terminated=batch[F.TERMINATED],
        truncated=batch[F.TRUNCATED],
        bootstrap=batch[F.BOOTSTRAP],
        discount=discount,
        gae_lambda=gae_lambda,
    )
    batch[F.VALUE], batch[F.ADVANTAGE], batch[F.RETURN] = value, advantage, returns
    batch[F.LOGPROB_PROX], batch[F.OLD_VPRED] = current["logprob"], current["vpred"]
    batch[F.STALENESS] = (version - batch[F.VERSION]).float()
    return batch
