"""From fetched fragment payloads to a training batch: chunk assembly and advantage estimation.

Each chunk's fragments are concatenated along time into one sequence of
``L = fragments_per_chunk * fragment_length`` steps; the chunks are stacked into (N, L, ...) tensors.
The recurrent state before the sequence is the first fragment's ``state_in`` (batch size 1 each,
concatenated along the batch axis), so a chunk trains as one sequence from where rollout started it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from mineonline_core.contracts import fragment as F
from mineonline_core.trainer.gae import compute_gae
from mineonline_core.trainer.sequence import forward_sequence, unwrap
from mineonline_core.contracts.tree import to_torch, tree_cat, tree_map, tree_stack


def assemble_chunks(chunks: list[list[dict]], *, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Stack chunks (each a list of consecutive fragments of one stream) into a (N, L) batch."""
    sequences = []
    for fragments in chunks:
        seq = {c: tree_cat([f[c] for f in fragments], axis=0) for c in F.STEP_COLUMNS}
        seq[F.NEXT_OBS] = fragments[-1][F.NEXT_OBS]
        seq[F.STATE_IN] = fragments[0][F.STATE_IN]
        seq[F.REF_STATE_IN] = fragments[0].get(F.REF_STATE_IN)
        sequences.append(seq)
    batch = {c: tree_stack([s[c] for s in sequences], axis=0) for c in (*F.STEP_COLUMNS,)}
    # Each fragment's next_obs leaves are (1, ...): stacked they are (N, 1, ...), one time step.
    batch[F.NEXT_OBS] = tree_stack([s[F.NEXT_OBS] for s in sequences], axis=0)
    for column in (F.STATE_IN, F.REF_STATE_IN):
        states = [s[column] for s in sequences]
        batch[column] = None if any(s is None for s in states) else tree_cat([tree_map(np.asarray, s) for s in states], axis=0)
    return to_torch(batch, device)


def denormalized_value(policy: nn.Module, vpred: torch.Tensor) -> torch.Tensor:
    head = getattr(unwrap(policy), "value_head", None)
    return head.denormalize(vpred) if head is not None and hasattr(head, "denormalize") else vpred


@torch.no_grad()
def current_policy_outputs(policy: nn.Module, batch: dict[str, Any], *, context_length: int) -> dict[str, Any]:
    """The *current* model over each whole chunk from its stored ``state_in``, without gradients.

    Returns ``pi_logits`` (leaves (N, L, ...)), ``logprob`` of the stored actions (N, L), ``vpred``
    (N, L), the value head's own (normalised) output, ``value`` (N, L) and ``next_value`` (N,)
    denormalised: the value of ``next_obs`` after the last step (its ``first`` flag is set when the
    last step ended an episode, though a bootstrap ignores it then).
    """
    policy = unwrap(policy)
    was_training = policy.training
    policy.eval()
    try:
        latents, state = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=context_length)
        done_last = (batch[F.TERMINATED][:, -1:] | batch[F.TRUNCATED][:, -1:]).bool()
        next_latents, _ = policy(input=batch[F.NEXT_OBS], state_in=state, context={"first": done_last})
    finally:
        policy.train(was_training)
    next_vpred = next_latents["vpred"]
    next_vpred = next_vpred[..., 0] if next_vpred.dim() == 3 else next_vpred
    return {
        "pi_logits": latents["pi_logits"],
        "logprob": policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"]).float(),
        "vpred": latents["vpred"].float(),
        "value": denormalized_value(policy, latents["vpred"]).float(),
        "next_value": denormalized_value(policy, next_vpred).float()[:, 0],
    }


@torch.no_grad()
def estimate_advantages(
    policy: nn.Module, batch: dict[str, Any], *, version: int, context_length: int, discount: float, gae_lambda: float
) -> dict[str, Any]:
    """Add ``value``, ``advantage``, ``return``, ``staleness`` and ``old_vpred`` (the value head's
    output, the centre of a clipped value loss) to ``batch``, all (N, L) float32: GAE over the
    current model's values (``current_policy_outputs``)."""
    current = current_policy_outputs(policy, batch, context_length=context_length)
    value = current["value"]
    advantage, returns = compute_gae(
        reward=batch[F.REWARD], value=value, next_value=current["next_value"], terminated=batch[F.TERMINATED],
        truncated=batch[F.TRUNCATED], bootstrap=batch[F.BOOTSTRAP], discount=discount, gae_lambda=gae_lambda,
    )  # fmt: skip
    batch[F.VALUE], batch[F.ADVANTAGE], batch[F.RETURN] = value, advantage, returns
    batch[F.OLD_VPRED] = current["vpred"]
    batch["staleness"] = (version - batch[F.VERSION]).float()
    return batch
