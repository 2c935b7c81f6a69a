"""An example third-party trainer: REINFORCE with a learned baseline (Williams 1992).

Install it next to mineonline (``pip install -e examples/custom_trainer``) and select it with
``trainer_name: ReinforceTrainer``. It shows everything a trainer plugin needs:

1. subclass ``mineonline_core.BaseTrainer`` and give it a ``name``;
2. implement ``setup_model_and_optimizer`` (return the module to train and its optimiser) and
   ``train`` (one iteration's update on this rank's batch, returning scalar metrics);
3. register the class with the ``mineonline_register_trainers`` hook and declare the module under
   the ``mineonline`` entry-point group in ``pyproject.toml``.

The core does the rest: fetching chunks, GAE (``batch["advantage"]``, ``batch["return"]``),
DDP, weight broadcast, checkpoints and metrics. The batch holds (N, L) tensors keyed by the
``mineonline_core.contracts.fragment`` column names plus ``advantage``, ``return``, ``value``, ``staleness``.
This trainer ignores staleness (no importance ratio), so keep ``max_staleness`` small.
"""

from __future__ import annotations

from typing import Any

import torch

import mineonline_core
from mineonline_core.contracts import fragment as F
from mineonline_core.trainer.sequence import forward_sequence


class ReinforceTrainer(mineonline_core.BaseTrainer):
    name = "ReinforceTrainer"

    def setup_model_and_optimizer(self, policy: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        tc = self.train_config
        return policy, torch.optim.Adam(policy.parameters(), lr=tc.learning_rate, eps=tc.adam_eps)

    def train(self, batch: dict) -> dict[str, float]:
        tc, head = self.train_config, self.policy
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        latents, _ = forward_sequence(self.model, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST],
                                      context_length=tc.context_length)  # fmt: skip
        logprob = head.pi_head.logprob(batch[F.ACTION], latents["pi_logits"])
        advantage = batch[F.ADVANTAGE]
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        # The policy gradient theorem: raise the log-probability of actions in proportion to how much
        # better than expected they turned out; the value head is the baseline.
        policy_loss = -(logprob * advantage).mean()
        value_loss = 0.5 * (latents["vpred"].squeeze(-1) - head.value_head.normalize(batch[F.RETURN])).pow(2).mean()
        entropy = head.pi_head.entropy(latents["pi_logits"]).mean()
        loss = policy_loss + tc.ppo_vf_coef * value_loss - tc.entropy_bonus_coef * entropy
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.max_grad_norm)
        terms = {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy.item()}
        if self.update_is_finite(grad_norm=grad_norm.item(), loss_terms=terms):  # a NaN step is skipped, counted
            self.optimizer.step()
        return {"trainer/policy_loss": policy_loss.item(), "trainer/value_loss": value_loss.item(),
                "trainer/entropy": entropy.item(), "trainer/grad_norm": grad_norm.item()}  # fmt: skip


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(ReinforceTrainer)
