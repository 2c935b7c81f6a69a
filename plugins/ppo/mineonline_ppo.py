"""PPOTrainer: proximal policy optimisation (Schulman et al. 2017) for mineonline.

Install with ``pip install mineonline-ppo`` and select it with ``trainer_name: PPOTrainer``.

The surrounding loop (fetching chunks, GAE, weight broadcast, checkpoints) is the core's
``BaseTrainer``; this module is the algorithm. Per iteration and rank it receives a batch of N chunks
of L steps and, for each of ``epochs_per_iteration`` passes, walks it in micro-batches of
``batch_size_per_gpu`` chunks, each chunk cut into ``context_length`` windows (truncated BPTT,
one backward per window to bound memory), summing gradients over ``gradient_accumulation``
micro-batches per optimiser step.

Definitions of the options whose meaning MineStudio leaves open:

* **ratio**: taken against the stored *behaviour* log-prob, so stale data is importance-corrected.
* **clip_vloss**: the new value may move at most ``ppo_clip`` (in normalised units) away from the
  behaviour value, as in the PPO2 baselines.
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
* **use_normalized_vf**: the value head's running normaliser is updated with the iteration's returns
  (gathered from every rank) and the head regresses the normalised returns.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mineonline_core
from mineonline_core.contracts import fragment as F
from mineonline_core.errors import ConfigError, RunFailedError
from mineonline_core.trainer.base import BaseTrainer
from mineonline_core.trainer.sequence import detach_state, slice_time, squeeze_value, windows
from mineonline_core.contracts.tree import tree_index, tree_map

METRICS = ("policy_loss", "value_loss", "entropy", "kl_ref", "approx_kl", "clipfrac", "ratio_deviation")


def ppo_loss(
    *,
    pi_head: nn.Module,
    pi_logits: Any,
    vpred: torch.Tensor,
    action: Any,
    behaviour_logprob: torch.Tensor,
    behaviour_vpred: torch.Tensor,
    advantage: torch.Tensor,
    value_target: torch.Tensor,
    ref_logits: Any,
    rho: float,
    clip: float,
    log_ratio_range: float,
    clip_vloss: bool,
    policy_coef: float,
    vf_coef: float,
    entropy_coef: float,
    warmup: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO objective (to minimise) over a window; values are in the head's normalised units."""
    # Clipped surrogate, eq. (7), with the ratio to the behaviour policy that collected the data.
    logprob = pi_head.logprob(action, pi_logits)
    log_ratio = (logprob - behaviour_logprob).clamp(-log_ratio_range, log_ratio_range)
    ratio = log_ratio.exp()
    surrogate = torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    policy_loss = -surrogate.mean()
    # Value regression, optionally clipped around the behaviour value.
    value_loss = (vpred - value_target) ** 2
    if clip_vloss:
        clipped = behaviour_vpred + (vpred - behaviour_vpred).clamp(-clip, clip)
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
        stats = {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(), "entropy": entropy.detach(), "kl_ref": kl_ref.detach(),
                 "approx_kl": ((ratio - 1) - log_ratio).mean(), "clipfrac": ((ratio - 1).abs() > clip).float().mean(),
                 "ratio_deviation": (ratio - 1).abs().max()}  # fmt: skip
    return loss, stats


class PPOTrainer(BaseTrainer):
    """PPO with importance-corrected ratios, KL to a reference policy and truncated BPTT."""

    name = "PPOTrainer"

    def preflight(self) -> None:
        super().preflight()
        self.check_policy(self.policy_generator())  # on the driver, before any Ray Train worker starts

    def check_policy(self, policy: nn.Module) -> None:
        """Options that mean nothing for this policy are rejected with the key and the fix."""
        tc = self.train_config
        if tc.freeze_pi_head and not list(getattr(policy, "pi_head", nn.Module()).parameters()):
            raise ConfigError(
                "train_config.freeze_pi_head: true freezes the policy's action decoder (pi_head), but "
                f"{type(policy).__name__} has no pi_head parameters. Set freeze_pi_head: false."
            )
        if tc.use_normalized_vf and not hasattr(getattr(policy, "value_head", None), "update_normalizer"):
            raise ConfigError(
                f"train_config.use_normalized_vf: true needs a value head with a running normaliser, but "
                f"{type(policy).__name__}.value_head has no update_normalizer(). Set use_normalized_vf: false."
            )

    def setup_model_and_optimizer(self, policy: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        tc = self.train_config
        self.check_policy(policy)
        if tc.freeze_pi_head:
            for param in policy.pi_head.parameters():
                param.requires_grad_(False)
        self.reference = None
        if tc.kl_divergence_coef_rho > 0:
            torch.manual_seed(int(getattr(self.config, "seed", 0) or 0))  # same weights as the initial policy
            self.reference = self.policy_generator().to(self.device).eval().requires_grad_(False)
        trainable = [p for p in policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=tc.learning_rate, eps=tc.adam_eps, weight_decay=tc.weight_decay)
        return policy, optimizer

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        if self.reference is not None and self.train_config.ref_update_at_checkpoint:
            self.reference.load_state_dict(self.policy.state_dict())

    def on_checkpoint(self, path: Any) -> None:
        if self.reference is not None and self.train_config.ref_update_at_checkpoint:
            self.reference.load_state_dict(self.policy.state_dict())
            self.reference_changed()

    # -- one iteration --------------------------------------------------------------------------

    def train(self, batch: dict) -> dict[str, float]:
        tc, policy = self.train_config, self.policy
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        warmup = self.iteration <= tc.vf_warmup
        value_only = warmup and tc.vf_warmup_value_head_only
        if tc.use_normalized_vf:
            returns = self._all_gather(batch[F.RETURN])
            # A NaN return would poison the running statistics for good; the loss is then
            # non-finite too, so the update guard skips this iteration's steps.
            if bool(torch.isfinite(returns).all()):
                policy.value_head.update_normalizer(returns)
        with torch.no_grad():
            value_target = policy.value_head.normalize(batch[F.RETURN]).float()
            behaviour_vpred = policy.value_head.normalize(batch[F.VPRED]).float()
        advantage = batch[F.ADVANTAGE]
        if tc.normalize_advantage_full_batch:
            mean, std = self._global_mean_std(advantage)
            advantage = (advantage - mean) / (std + 1e-8)
        n, per_batch, accum = advantage.shape[0], tc.batch_size_per_gpu, tc.gradient_accumulation
        num_batches = math.ceil(n / per_batch)
        totals: dict[str, float] = {k: 0.0 for k in METRICS}
        group: dict[str, float] = {k: 0.0 for k in METRICS}  # loss terms since the last optimiser step
        grad_norms: list[float] = []
        for _ in range(tc.epochs_per_iteration):
            order = torch.randperm(n, device=advantage.device)  # new minibatches every epoch
            for b in range(num_batches):
                rows = order[b * per_batch : (b + 1) * per_batch]
                group_start = (b // accum) * accum
                step_now = (b + 1) % accum == 0 or b == num_batches - 1
                adv = advantage[rows]
                if tc.normalize_advantage_per_minibatch:
                    adv = (adv - adv.mean()) / (adv.std(correction=0) + 1e-8)
                stats = self._backward(batch, rows, adv, value_target[rows], behaviour_vpred[rows],
                                       sync=step_now, scale=1.0 / min(accum, num_batches - group_start),
                                       warmup=warmup)  # fmt: skip
                for k in METRICS:
                    totals[k] += stats[k]
                    group[k] += stats[k]
                if step_now:
                    grad_norm = self._optimizer_step(value_only, group)
                    grad_norms += [] if grad_norm is None else [grad_norm]
                    group = {k: 0.0 for k in METRICS}
        count = tc.epochs_per_iteration * num_batches
        metrics = {f"trainer/{k}": v / count for k, v in totals.items()}
        metrics["trainer/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        returns, values = batch[F.RETURN], batch[F.VALUE]
        metrics["trainer/explained_variance"] = float(1 - (returns - values).var() / returns.var().clamp(min=1e-8))
        metrics["trainer/value_only"] = float(value_only)
        metrics["trainer/vf_warmup"] = float(warmup)
        return metrics

    def _backward(self, batch: dict, rows: torch.Tensor, advantage: torch.Tensor, value_target: torch.Tensor,
                  behaviour_vpred: torch.Tensor, *, sync: bool, scale: float, warmup: bool) -> dict[str, float]:  # fmt: skip
        """Forward/backward one micro-batch window by window; gradients accumulate in ``.grad``."""
        tc = self.train_config
        obs = tree_index(batch[F.OBS], rows)
        first, action = batch[F.FIRST][rows], tree_index(batch[F.ACTION], rows)
        state = tree_index(batch[F.STATE_IN], rows)
        # The reference carries its own recurrent state, recorded by rollout at each fragment start (§5.4).
        ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None
        use_reference = self.reference is not None and (self.rho > 0 or warmup)
        if use_reference and ref_state is None and state is not None:
            raise RunFailedError(
                "The KL reference policy is recurrent but these chunks carry no reference state (ref_state_in): "
                "they were collected without the reference (a replay store from a run with "
                "kl_divergence_coef_rho: 0). Start with a fresh replay store (database_config.path)."
            )
        length = first.shape[1]
        spans = windows(length, tc.context_length)
        totals = {k: 0.0 for k in METRICS}
        amp_dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        for i, window in enumerate(spans):
            # DDP all-reduces only on the very last backward before an optimiser step.
            last = sync and i == len(spans) - 1
            no_sync = self.model.no_sync() if hasattr(self.model, "no_sync") and not last else contextlib.nullcontext()
            context = {"first": first[:, window]}
            window_obs = slice_time(obs, window)
            with no_sync:
                with torch.autocast(self.device.type, dtype=amp_dtype, enabled=tc.use_amp):
                    latents, state_out = self.model(input=window_obs, state_in=state, context=context)
                    ref_logits = None
                    if use_reference:
                        with torch.no_grad():
                            ref_latents, ref_state = self.reference(input=window_obs, state_in=ref_state, context=context)
                        ref_logits = _float(ref_latents["pi_logits"])
                loss, stats = ppo_loss(
                    pi_head=self.policy.pi_head, pi_logits=_float(latents["pi_logits"]),
                    vpred=squeeze_value(latents["vpred"]).float(), action=slice_time(action, window),
                    behaviour_logprob=batch[F.LOGPROB][rows, window], behaviour_vpred=behaviour_vpred[:, window],
                    advantage=advantage[:, window], value_target=value_target[:, window], ref_logits=ref_logits,
                    rho=self.rho, clip=tc.ppo_clip, log_ratio_range=tc.log_ratio_range, clip_vloss=tc.clip_vloss,
                    policy_coef=tc.ppo_policy_coef, vf_coef=tc.ppo_vf_coef, entropy_coef=tc.entropy_bonus_coef,
                    warmup=warmup,
                )  # fmt: skip
                weight = (window.stop - window.start) / length
                self.scaler.scale(loss * weight * scale).backward()
            state = detach_state(state_out)
            for k in METRICS:
                totals[k] += float(stats[k]) * weight
        return totals

    def _optimizer_step(self, value_only: bool, loss_terms: dict[str, float]) -> float | None:
        """Clip and step; None when the step was skipped for non-finite loss terms or gradients."""
        tc = self.train_config
        self.scaler.unscale_(self.optimizer)
        if value_only:
            keep = {id(p) for p in self.policy.value_head.parameters()}
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    if id(param) not in keep:
                        param.grad = None  # AdamW skips it entirely: no step, no weight decay
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm)
        if not self.update_is_finite(grad_norm=float(grad_norm), loss_terms=loss_terms):
            if self.scaler.is_enabled():
                self.scaler.update()  # an fp16 overflow: the scaler lowers its scale, as its own skip would
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- cross-rank statistics ------------------------------------------------------------------

    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _global_mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.stack([x.double().sum(), (x.double() ** 2).sum(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)])
        if self._distributed():
            dist.all_reduce(sums)
        mean = sums[0] / sums[2]
        var = (sums[1] / sums[2] - mean**2).clamp(min=0) * sums[2] / (sums[2] - 1).clamp(min=1)
        return mean.float(), var.sqrt().float()

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self._distributed():
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)


def _float(tree: Any) -> Any:
    return tree_map(lambda x: x.float(), tree)


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(PPOTrainer)
