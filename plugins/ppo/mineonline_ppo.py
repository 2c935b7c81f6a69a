"""PPOTrainer: proximal policy optimisation (Schulman et al. 2017), decoupled (Hilton et al. 2021).

Install with ``pip install mineonline-ppo`` and select it with ``trainer_name: PPOTrainer``.

The core's ``TrainLoop`` runs everything around the algorithm: fetching chunks, GAE, the update
loop (epochs, micro-batches, BPTT windows, accumulation, DDP, AMP, clipping), broadcasts and
checkpoints. This module is the algorithm: its options (``PPOConfig``, the ``train_config`` keys the
core does not own), its loss (``ppo_loss``, per window) and the schedule around it.

Definitions of the options whose meaning MineStudio leaves open:

* **ratio** (the decoupled objective of Hilton et al. 2021, "Batch size-invariance for policy
  optimization", §3): ``r = pi_theta / pi_prox`` is clipped against the *proximal* policy, the model
  at the start of the update as the update itself runs it (the estimate pass records
  ``logprob_prox`` in the training numerics and micro-batch shapes), and each step is weighted by
  ``w = min(pi_prox / mu, behaviour_weight_clip)``, ``mu`` the stored *behaviour* log-prob, so stale
  data is importance-corrected. On on-policy data ``r`` starts at exactly 1 whatever
  the precision of rollout and training; with fp32 on both sides ``w`` is 1 too and this is
  plain PPO. One objective, no switch: where the two differ, the plain one is the wrong one (it
  clips precision noise, and clips stale data against a policy the update never started from).
* **clip_vloss**: the new value may move at most ``ppo_clip`` (in normalised units) away from the
  value head's output at the start of the update (``old_vpred``: the current model's, from the
  estimate pass, before the normaliser moves), as in the PPO2 baselines, CleanRL and MineStudio. On
  on-policy data the first step's clipped and unclipped value losses are then the same.
* **KL penalty**: ``rho * KL(pi_theta || pi_ref)`` (MineStudio 1.1's order too), with ``pi_ref`` a
  frozen copy from ``policy_generator()`` run over the same chunks with its own recurrent state:
  rollout runs the reference beside the behaviour policy and stores its state at each fragment
  start (``ref_state_in``). ``rho = kl_divergence_coef_rho * coef_rho_decay ** (iteration - 1)``;
  at 0 the reference is never built.
* **vf_warmup** (MineStudio's meaning): in the first ``vf_warmup`` iterations the loss is the value
  loss plus the KL at weight 1, every parameter is trained, and no new version is broadcast.
  ``vf_warmup_value_head_only`` updates only ``value_head`` parameters instead, so the policy the
  workers run is the policy being trained.
* **normalize_advantage_full_batch** (MineStudio's meaning): ``false`` leaves advantages as they are;
  ``normalize_advantage_per_minibatch`` normalises each micro-batch instead.
* **fix_decoder**, **enable_ref_update**: read by nothing in MineStudio's PPOTrainer, so they do
  nothing here either (a warning says so); ``freeze_pi_head`` freezes the action decoder and
  ``ref_update_at_checkpoint`` refreshes the reference to the current weights at every checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import nn

import mineonline_core
from mineonline_core import Algorithm, TrainerOptions, setting
from mineonline_core.contracts.batch import Columns, ModelOutputs, Outputs, TrainBatch
from mineonline_core.contracts.policy import zero_value_head
from mineonline_core.errors import ConfigError, RunFailedError


class PPOConfig(TrainerOptions):
    """PPOTrainer's ``train_config`` keys (MineStudio's names, plus mineonline's variants)."""

    ppo_clip: float = setting(
        0.2,
        "PPO clip epsilon: the ratio to the proximal policy (the model at the start of the update) is clipped to "
        "[1-e, 1+e].",
        gt=0,
    )
    behaviour_weight_clip: float = setting(
        2.0,
        "Truncation c of the importance weight w = min(pi_prox / mu, c) by which the decoupled PPO objective "
        "corrects for the behaviour policy mu that collected the data (pi_prox: the model at the start of the "
        "update). Hilton et al.'s code truncates only extreme weights (at 100), which keeps the bias small; 2 "
        "never truncates what training precision or a version or two of staleness produce, and keeps one stale "
        "action from outweighing a micro-batch of batch_size_per_gpu: 1. 1 is V-trace's rho-bar; a large value "
        "turns the truncation off.",
        ge=1,
    )
    clip_vloss: bool = Field(
        False,
        description="Clip the value loss around the value head's output at the start of the update, like the ratio.",
    )
    ppo_policy_coef: float = setting(1.0, "Weight of the clipped policy loss.", ge=0)
    ppo_vf_coef: float = setting(0.5, "Weight of the value loss.", ge=0)
    entropy_bonus_coef: float = setting(0.0, "Weight of the entropy bonus.", ge=0)
    kl_divergence_coef_rho: float = setting(
        0.0,
        "Initial weight of the penalty KL(policy || reference), the reference being the frozen "
        "initial (pretrained) policy run with its own recurrent state; the same direction as "
        "MineStudio 1.1 (before May 2025 MineStudio took KL(reference || policy)). 0 disables it "
        "(MineStudio's cow example: 0.2).",
        ge=0,
    )
    coef_rho_decay: float = setting(0.9995, "Factor the KL weight is multiplied by after each iteration.", gt=0, le=1)
    log_ratio_range: float = setting(
        50.0, "Log-probability ratios are clamped to +-this before exp, for stability.", gt=0
    )
    normalize_advantage_full_batch: bool = Field(
        True,
        description="Normalise advantages over an iteration's whole batch (every rank); false "
        "leaves them unnormalised, as in MineStudio (see normalize_advantage_per_minibatch).",
    )
    normalize_advantage_per_minibatch: bool = Field(
        False,
        description="mineonline option: normalise advantages within each micro-batch of "
        "batch_size_per_gpu chunks (applied after the full-batch normalisation, if any). With "
        "batch_size_per_gpu: 1 and advantages of one sign this removes most of the policy gradient.",
    )
    vf_warmup: int = setting(
        0,
        "First iterations trained on the value loss plus the KL to the reference (weight 1), "
        "without broadcasting the weights; every parameter is updated, as in MineStudio "
        "(see vf_warmup_value_head_only). 0 trains the policy from the start.",
        ge=0,
    )
    vf_warmup_value_head_only: bool = Field(
        False,
        description="mineonline's warm-up: during vf_warmup update only the value head's parameters, "
        "so the policy the rollout workers run stays the policy being trained. MineStudio has no "
        "such option (its warm-up updates every parameter).",
    )
    zero_initial_vf: bool = Field(
        True,
        description="Zero every parameter of the value head at start, its normaliser's running "
        "statistics included, as MineStudio does (see zero_initial_vf_keep_normalizer).",
    )
    zero_initial_vf_keep_normalizer: bool = Field(
        False,
        description="mineonline's zero_initial_vf: zero only the value head's output layer and keep "
        "the normaliser's statistics (a pretrained head then starts at its return scale). "
        "MineStudio has no such option.",
    )
    freeze_pi_head: bool = Field(
        False, description="mineonline option: freeze the policy's action decoder (pi_head) during training."
    )
    ref_update_at_checkpoint: bool = Field(
        False,
        description="mineonline option: copy the trained weights into the KL reference at every "
        "checkpoint (and on resume); rollout workers receive the new reference with the next broadcast.",
    )
    fix_decoder: bool = setting(
        False,
        "MineStudio-only, accepted and ignored with a warning: MineStudio's online trainer "
        "reads it nowhere. See freeze_pi_head.",
        ignored="MineStudio's online trainer reads it nowhere; set freeze_pi_head: true to freeze the action decoder",
    )
    enable_ref_update: bool = setting(
        False,
        "MineStudio-only, accepted and ignored with a warning: MineStudio's PPOTrainer "
        "reads it nowhere (its PPOBCTrainer copies the policy into the reference whenever a batch's "
        "reward sum is a new best). See ref_update_at_checkpoint.",
        ignored="MineStudio's PPOTrainer reads it nowhere; set ref_update_at_checkpoint: true "
        "to refresh the KL reference at every checkpoint",
    )


def ppo_loss(
    *,
    pi_head: nn.Module,
    pi_logits: Any,
    vpred: torch.Tensor,
    action: Any,
    behaviour_logprob: torch.Tensor,
    proximal_logprob: torch.Tensor,
    old_vpred: torch.Tensor,
    advantage: torch.Tensor,
    value_target: torch.Tensor,
    ref_logits: Any,
    rho: float,
    clip: float,
    behaviour_weight_clip: float,
    log_ratio_range: float,
    clip_vloss: bool,
    policy_coef: float,
    vf_coef: float,
    entropy_coef: float,
    warmup: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The decoupled PPO objective (to minimise) over a window; values in the head's normalised units.

    Hilton et al. 2021, §3, with the behaviour weight truncated at ``c = behaviour_weight_clip``::

        L(theta) = E_t[ w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) ],
        r_t = pi_theta(a_t|s_t) / pi_prox(a_t|s_t),   w_t = min(pi_prox(a_t|s_t) / mu(a_t|s_t), c)

    (PPO's eq. (7) when ``pi_prox == mu``). ``w_t`` is data, not a function of ``theta``.
    """
    logprob = pi_head.logprob(action, pi_logits)
    # r_t: the ratio to the proximal policy bounds how far one update moves the policy.
    log_ratio = (logprob - proximal_logprob).clamp(-log_ratio_range, log_ratio_range)
    ratio = log_ratio.exp()
    # w_t: the off-policy correction from the behaviour policy that chose the action.
    log_weight = (proximal_logprob - behaviour_logprob).clamp(-log_ratio_range, log_ratio_range)
    weight = log_weight.exp().clamp(max=behaviour_weight_clip)
    surrogate = weight * torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    policy_loss = -surrogate.mean()
    # Value regression, optionally clipped around the head's output at the start of the update.
    value_loss = (vpred - value_target) ** 2
    if clip_vloss:
        clipped = old_vpred + (vpred - old_vpred).clamp(-clip, clip)
        value_loss = torch.max(value_loss, (clipped - value_target) ** 2)
    value_loss = 0.5 * value_loss.mean()
    entropy = pi_head.entropy(pi_logits).mean()
    kl_ref = pi_head.kl_divergence(pi_logits, ref_logits).mean() if ref_logits is not None else torch.zeros(())
    # Eq. (9): policy and entropy terms, plus the KL penalty towards the reference policy.
    policy_terms = policy_coef * policy_loss - entropy_coef * entropy
    if warmup:
        # MineStudio's vf_warmup objective: the value loss plus the KL to the reference at weight 1.
        # The policy terms stay in the graph at weight 0, so that DDP sees a gradient for every parameter.
        loss = vf_coef * value_loss + kl_ref + 0.0 * policy_terms
    else:
        loss = vf_coef * value_loss + policy_terms + rho * kl_ref
    with torch.no_grad():
        stats = {
            "policy_loss": policy_loss.detach(),
            "value_loss": value_loss.detach(),
            "entropy": entropy.detach(),
            "kl_ref": kl_ref.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clipfrac": ((ratio - 1).abs() > clip).float().mean(),
            "ratio_deviation": (ratio - 1).abs().max(),
            "behaviour_weight_mean": weight.mean(),
            "behaviour_weight_clipfrac": (log_weight.exp() > behaviour_weight_clip).float().mean(),
            # KL(mu || pi_prox) over the actions mu chose: what the behaviour weight corrects.
            "behaviour_kl": ((log_weight.exp() - 1) - log_weight).mean(),
        }
    return loss, stats


class PPOTrainer(Algorithm):
    """Decoupled PPO (clipped against the proximal policy, importance-weighted from the behaviour
    policy), KL to a reference policy and a value warm-up."""

    name = "PPOTrainer"
    Config = PPOConfig
    options: PPOConfig

    # -- the loss ---------------------------------------------------------------------------------

    def compute_loss(self, *, batch: TrainBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        o = self.options
        return ppo_loss(
            pi_head=self.ctx.policy.pi_head,
            pi_logits=outputs[Outputs.PI_LOGITS],
            vpred=outputs[Outputs.VPRED],
            action=batch[Columns.ACTION],
            behaviour_logprob=batch[Columns.LOGPROB],
            proximal_logprob=batch[Columns.LOGPROB_PROX],
            old_vpred=batch[Columns.OLD_VPRED],
            advantage=batch[Columns.ADVANTAGE],
            value_target=batch[Columns.VALUE_TARGET],
            ref_logits=outputs[Outputs.REF_LOGITS],
            rho=self.rho,
            clip=o.ppo_clip,
            behaviour_weight_clip=o.behaviour_weight_clip,
            log_ratio_range=o.log_ratio_range,
            clip_vloss=o.clip_vloss,
            policy_coef=o.ppo_policy_coef,
            vf_coef=o.ppo_vf_coef,
            entropy_coef=o.entropy_bonus_coef,
            warmup=self.warmup,
        )

    def prepare_batch(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        if Columns.LOGPROB_PROX not in batch:
            raise RunFailedError(
                f"{type(self).__name__}'s decoupled objective needs the proximal log-prob of the stored actions "
                f"(batch column {Columns.LOGPROB_PROX!r}), which the default estimate records, but this trainer's "
                "estimate returned no such column. Add it from the estimate's own pass: "
                "batch[Columns.LOGPROB_PROX] = self.ctx.current_policy_outputs(batch=batch)['logprob']."
            )
        if self.options.normalize_advantage_full_batch:
            mean, std = self.ctx.global_mean_std(batch[Columns.ADVANTAGE])
            batch = {**batch, Columns.ADVANTAGE: (batch[Columns.ADVANTAGE] - mean) / (std + 1e-8)}
        return batch

    def prepare_minibatch(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        if self.options.normalize_advantage_per_minibatch:
            advantage = batch[Columns.ADVANTAGE]
            batch = {**batch, Columns.ADVANTAGE: (advantage - advantage.mean()) / (advantage.std(correction=0) + 1e-8)}
        return batch

    # -- schedules --------------------------------------------------------------------------------

    def rho_at(self, iteration: int) -> float:
        return self.options.kl_divergence_coef_rho * self.options.coef_rho_decay ** (iteration - 1)

    @property
    def rho(self) -> float:
        """The KL weight of the current iteration."""
        return self.rho_at(self.ctx.iteration)

    @property
    def warmup(self) -> bool:
        """The current iteration is one of the first ``vf_warmup``."""
        return self.ctx.iteration <= self.options.vf_warmup

    def publishes_version(self, iteration: int) -> bool:
        return iteration > self.options.vf_warmup

    def uses_reference(self) -> bool:
        return self.ctx.reference is not None and (self.rho > 0 or self.warmup)

    def filter_gradients(self) -> None:
        if self.warmup and self.options.vf_warmup_value_head_only:
            keep = {id(p) for p in self.ctx.policy.value_head.parameters()}
            for group in self.ctx.optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in keep:
                        param.grad = None  # AdamW skips it entirely: no step, no weight decay

    def iteration_metrics(self) -> dict[str, float]:
        return {
            "trainer/rho": self.rho,
            "trainer/vf_warmup": float(self.warmup),
            "trainer/value_only": float(self.warmup and self.options.vf_warmup_value_head_only),
        }

    # -- model, reference, checkpoints ------------------------------------------------------------

    def check_policy(self, policy: nn.Module) -> None:
        super().check_policy(policy)
        if self.options.freeze_pi_head and not list(getattr(policy, "pi_head", nn.Module()).parameters()):
            raise ConfigError(
                "train_config.freeze_pi_head: true freezes the policy's action decoder (pi_head), but "
                f"{type(policy).__name__} has no pi_head parameters. Set freeze_pi_head: false."
            )

    def init_policy(self, policy: nn.Module) -> None:
        if self.options.zero_initial_vf:
            zero_value_head(policy.value_head, keep_normalizer=self.options.zero_initial_vf_keep_normalizer)

    @classmethod
    def has_reference(cls, options: Any) -> bool:
        return options.kl_divergence_coef_rho > 0

    def setup_model_and_optimizer(self, policy: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.options.freeze_pi_head:
            for param in policy.pi_head.parameters():
                param.requires_grad_(False)
        return super().setup_model_and_optimizer(policy)

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        if self.ctx.reference is not None and self.options.ref_update_at_checkpoint:
            self.ctx.reference.load_state_dict(self.ctx.policy.state_dict())
            self.ctx.reference_changed()  # the store may hold logits of the reference before the resume

    def on_checkpoint(self, path: Any) -> None:
        if self.ctx.reference is not None and self.options.ref_update_at_checkpoint:
            self.ctx.reference.load_state_dict(self.ctx.policy.state_dict())
            self.ctx.reference_changed()


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(PPOTrainer)
