"""What ``Algorithm.compute_loss(*, batch, outputs)`` receives: every batch column and model output, by name.

Use the names, not string literals: ``batch[Columns.ADVANTAGE]``, ``outputs[Outputs.PI_LOGITS]``. The
``TypedDict``\\ s ``TrainBatch`` and ``ModelOutputs`` type the two arguments; ``tests/test_batch_contract.py``
holds the real loop to them (keys, dtypes, shapes).

Shapes: B is the micro-batch's chunks (``batch_size_per_gpu``, fewer in the last one), T the window's steps
(``context_length``, fewer in a chunk's last window). A *tree* is a dict (possibly nested) of tensors, each
leaf (B, T, ...). **Return units** are the env's reward summed over steps (rewards divided by the running
return scale when the policy has a reward normaliser, ``normalize_rewards``); **head units** are the value
head's own output, the return normalised by its running mean and std when ``use_normalized_vf`` (return
units otherwise). Compare a value only with one in the same units.

``batch`` (``TrainBatch``), every per-step column of the iteration's batch, sliced to the window:

==================  ========================  =========================================================
``obs``             tree (B, T, ...)          the observation the behaviour policy acted on
``action``          tree (B, T, ...)          what ``pi_head.sample`` returned (int64 for discrete)
``reward``          float32 (B, T)            the env's reward (scaled under ``normalize_rewards``)
``terminated``      bool (B, T)               a true terminal state: no bootstrap
``truncated``       bool (B, T)               cut (time limit, env crash or hang): bootstrap
``first``           bool (B, T)               the first step of an episode
``logprob``         float32 (B, T)            the *behaviour* policy's log-prob of ``action`` (rollout's)
``vpred``           float32 (B, T)            the behaviour policy's value, return units (not the
                                              output of the same name: that one is in head units)
``bootstrap``       float32 (B, T)            at truncated steps the value of the cut-off observation,
                                              return units; 0 elsewhere
``episode_id``      int64 (B, T)              a per-stream episode counter
``version``         int64 (B, T)              the model version that chose each action
``ref_logits``      float32 tree like below   the KL reference's logits stored by rollout; only when
                                              every fragment of the batch has them
``staleness``       float32 (B, T)            trainer version minus ``version`` at fetch (for logs)
``value``           float32 (B, T)            the current model's value before the update, return units
``advantage``       float32 (B, T)            the estimate's advantage (GAE by default), return units;
                                              ``PPOTrainer`` normalises it over the whole batch of every
                                              rank (``normalize_advantage_full_batch``, default on) and/or
                                              per micro-batch (``normalize_advantage_per_minibatch``) in
                                              its ``prepare_batch``/``prepare_minibatch``; the core never does
``return``          float32 (B, T)            the value target, return units (GAE's lambda-return; V-trace's v_s)
``logprob_prox``    float32 (B, T)            the current model's log-prob of ``action`` at the start of
                                              the update (the default estimate's; absent when an
                                              algorithm's own ``estimate`` does not add it)
``old_vpred``       float32 (B, T)            the value head's output at the start of the update, head units
``value_target``    float32 (B, T)            ``return`` in head units (after this iteration's normaliser
                                              update): what ``outputs["vpred"]`` regresses
``reward_raw``      float32 (B, T)            the rewards before scaling; only under ``normalize_rewards``
==================  ========================  =========================================================

An algorithm's ``estimate`` may add columns of its own (V-trace's ``vtrace_rho``): any tensor (N, L) of
the iteration's batch reaches ``compute_loss`` sliced like the others. The iteration's batch also holds
``next_obs`` (leaves (N, 1, ...)), ``state_in`` and ``ref_state_in`` (recurrent states before each chunk,
or None), seen by ``estimate``/``prepare_batch`` but never sliced into windows.

``outputs`` (``ModelOutputs``), the policy's forward over the window, float32:

==================  ========================  =========================================================
``pi_logits``       float32 tree (B, T, ...)  whatever ``pi_head`` reads (log-probs; mean and log-std)
``vpred``           float32 (B, T)            the value head's output, **head units**, with gradient
``ref_logits``      tree like ``pi_logits``   the KL reference's logits, no gradient; None unless
                                              ``uses_reference()``
==================  ========================  =========================================================

plus any other key the policy's forward returned in its latents, as it returned it.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired  # in typing from Python 3.11; pydantic brings it

from mineonline_core.contracts.columns import Columns, Outputs

__all__ = ["COLUMN_DTYPES", "OUTPUT_DTYPES", "Columns", "ModelOutputs", "Outputs", "TrainBatch"]


# Functional form: ``return`` is a Python keyword. Per-key facts: the module docstring's table.
TrainBatch = TypedDict(
    "TrainBatch",
    {
        "obs": Any,
        "action": Any,
        "reward": torch.Tensor,
        "terminated": torch.Tensor,
        "truncated": torch.Tensor,
        "first": torch.Tensor,
        "logprob": torch.Tensor,
        "vpred": torch.Tensor,
        "bootstrap": torch.Tensor,
        "episode_id": torch.Tensor,
        "version": torch.Tensor,
        "ref_logits": NotRequired[Any],
        "staleness": torch.Tensor,
        "value": torch.Tensor,
        "advantage": torch.Tensor,
        "return": torch.Tensor,
        "logprob_prox": NotRequired[torch.Tensor],
        "old_vpred": torch.Tensor,
        "value_target": torch.Tensor,
        "reward_raw": NotRequired[torch.Tensor],
    },
)
TrainBatch.__doc__ = "``compute_loss``'s ``batch``: one window of one micro-batch (see the module docstring)."


class ModelOutputs(TypedDict):
    """``compute_loss``'s ``outputs``: the policy's forward over the window (see the module docstring)."""

    pi_logits: Any
    vpred: torch.Tensor
    ref_logits: Any


# Each key's dtype (every leaf's, for a tree); None: the env's or policy's own. Every leaf is (B, T, ...).
# ``tests/test_batch_contract.py`` holds the real loop to these and these to the TypedDicts' keys.
COLUMN_DTYPES: dict[str, torch.dtype | None] = {
    Columns.OBS: None,
    Columns.ACTION: None,
    Columns.REWARD: torch.float32,
    Columns.TERMINATED: torch.bool,
    Columns.TRUNCATED: torch.bool,
    Columns.FIRST: torch.bool,
    Columns.LOGPROB: torch.float32,
    Columns.VPRED: torch.float32,
    Columns.BOOTSTRAP: torch.float32,
    Columns.EPISODE_ID: torch.int64,
    Columns.VERSION: torch.int64,
    Columns.REF_LOGITS: torch.float32,
    Columns.STALENESS: torch.float32,
    Columns.VALUE: torch.float32,
    Columns.ADVANTAGE: torch.float32,
    Columns.RETURN: torch.float32,
    Columns.LOGPROB_PROX: torch.float32,
    Columns.OLD_VPRED: torch.float32,
    Columns.VALUE_TARGET: torch.float32,
    Columns.REWARD_RAW: torch.float32,
}
OUTPUT_DTYPES: dict[str, torch.dtype | None] = {
    Outputs.PI_LOGITS: torch.float32,
    Outputs.VPRED: torch.float32,
    Outputs.REF_LOGITS: torch.float32,
}
