"""A third-party trainer: REINFORCE with a learned baseline (Williams 1992), as a loss and a Config.

Install it next to mineonline (``pip install -e examples/custom_trainer``) and select it with
``trainer_name: ReinforceTrainer``; its two keys sit in ``train_config`` beside the core's. The
core runs everything else: fetching chunks, GAE (the ``advantage`` column), epochs, micro-batches
of ``batch_size_per_gpu`` chunks, ``context_length`` windows, ``gradient_accumulation``, DDP,
``use_amp``, gradient clipping and checkpoints. ``docs/plugins.md`` describes it and
``docs/tutorial-trainer-plugin.md`` builds a trainer of the same shape step by step.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

import mineonline_core
from mineonline_core.contracts.batch import Columns, ModelOutputs, Outputs, TrainBatch


class ReinforceConfig(mineonline_core.TrainerOptions):
    """ReinforceTrainer's ``train_config`` keys."""

    vf_coef: float = Field(0.5, ge=0, description="Weight of the baseline's value loss.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")


class ReinforceTrainer(mineonline_core.Algorithm):
    name = "ReinforceTrainer"
    Config = ReinforceConfig

    def compute_loss(self, *, batch: TrainBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One window of one micro-batch: ``batch`` columns are (chunks, steps) slices."""
        pi_head, logits = self.ctx.policy.pi_head, outputs[Outputs.PI_LOGITS]
        # The policy gradient theorem: raise the log-probability of actions in proportion to how much
        # better than expected they turned out; the value head is the baseline. No importance ratio:
        # keep max_staleness small.
        policy_loss = -(pi_head.logprob(batch[Columns.ACTION], logits) * batch[Columns.ADVANTAGE]).mean()
        value_loss = 0.5 * (outputs[Outputs.VPRED] - batch[Columns.VALUE_TARGET]).pow(2).mean()
        entropy = pi_head.entropy(logits).mean()
        loss = policy_loss + self.options.vf_coef * value_loss - self.options.entropy_coef * entropy
        return loss, {
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": entropy.detach(),
        }


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(ReinforceTrainer)
