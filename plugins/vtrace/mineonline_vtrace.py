"""VTraceTrainer: off-policy actor-critic with V-trace targets (Espeholt et al. 2018, IMPALA).

Install with ``pip install mineonline-vtrace`` and select it with ``trainer_name: VTraceTrainer``.

Rollout workers act with the policy of some earlier model version (the *behaviour* policy ``mu``,
whose log-prob of each action is stored in the fragment); the trainer's current network is the
*target* policy ``pi``. V-trace corrects for the gap with truncated importance weights, so rollout may
run further ahead of training than PPO tolerates: ``max_staleness`` of 4-8 is fine here.

APPO-style, the targets are computed once per iteration, without gradient, over whole chunks with the
network as it is before the iteration's update (``estimate``); the update then regresses the value
towards them and follows the policy gradient of §4.2 (``vtrace_loss``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

import mineonline_core
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.tree import tree_index
from mineonline_core.trainer.base import BaseTrainer
from mineonline_core.trainer.batch import denormalized_value
from mineonline_core.trainer.sequence import detach_state, forward_sequence, slice_time, squeeze_value, unwrap, windows

# Batch columns added by VTraceTrainer.estimate, (N, L): the truncated importance weight rho_s of the
# network before the update, and r_s + gamma v_{s+1} - V(x_s) of the policy gradient.
RHO = "vtrace_rho"
PG_DELTA = "vtrace_pg_delta"
METRICS = ("policy_loss", "value_loss", "entropy")


class VTraceTargets(NamedTuple):
    vs: torch.Tensor  # v_s, the value target of each step (N, L)
    pg_delta: torch.Tensor  # r_s + gamma v_{s+1} - V(x_s), (N, L)
    rho: torch.Tensor  # rho_s = min(rho_bar, pi/mu), (N, L)

    @property
    def pg_advantage(self) -> torch.Tensor:
        """The policy-gradient advantage of §4.2, rho_s (r_s + gamma v_{s+1} - V(x_s))."""
        return self.rho * self.pg_delta


def vtrace(
    *,
    behaviour_logprob: torch.Tensor,
    target_logprob: torch.Tensor,
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    bootstrap: torch.Tensor,
    discount: float,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> VTraceTargets:
    """V-trace targets over chunks (N, L): IMPALA eq. (1) and the advantage of §4.2.

    With ``rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))``, ``c_i = min(c_bar, pi(a_i|x_i) / mu(a_i|x_i))``
    and ``delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t))``, eq. (1) is::

        v_s = V(x_s) + sum_{t=s}^{s+n-1} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t V

    computed here through its recursive form (§4.1, Remark 1)::

        v_s = V(x_s) + delta_s V + gamma c_s (v_{s+1} - V(x_{s+1}))

    backwards in time, vectorised over the N chunks. The sum runs to the end of the episode or of the
    chunk; past the chunk's last step ``v_L = V(x_L) = next_value`` (the n-step bootstrap).
    Episode ends are those of ``compute_gae``: after a ``terminated`` step ``V(x_{t+1}) = 0``; after a
    ``truncated`` one it is the stored ``bootstrap[t]``; in both the sum stops there, because step
    ``t + 1`` belongs to the next episode. The policy-gradient advantage (§4.2) uses, as its
    ``v_{s+1}``, the next step's target inside an episode and that same end value past it.

    ``behaviour_logprob`` is log mu, ``target_logprob`` log pi, ``value`` and ``bootstrap`` are
    denormalised V(x_s) (N, L), ``next_value`` (N,). ``rho_bar`` and ``c_bar`` may be ``math.inf``.
    """
    reward, value, bootstrap = reward.float(), value.float(), bootstrap.float()
    terminated, truncated = terminated.bool(), truncated.bool()
    n = reward.shape[0]
    ratio = (target_logprob.float() - behaviour_logprob.float()).exp()
    rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)

    def after(values: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The value of the state each step leads to: ``values[t + 1]`` inside an episode and the
        chunk, ``last`` past the chunk, the stored bootstrap at a truncation, 0 at a termination."""
        following = torch.cat([values[:, 1:], last.float().reshape(n, 1)], dim=1)
        following = torch.where(truncated, bootstrap, following)
        return torch.where(terminated, torch.zeros_like(following), following)

    delta = rho * (reward + discount * after(value, next_value) - value)
    carry = discount * c * (~(terminated | truncated)).float()
    correction = torch.zeros_like(value)  # v_s - V(x_s)
    running = torch.zeros(n, dtype=value.dtype, device=value.device)
    for t in range(reward.shape[1] - 1, -1, -1):
        running = delta[:, t] + carry[:, t] * running
        correction[:, t] = running
    vs = value + correction
    return VTraceTargets(vs=vs, pg_delta=reward + discount * after(vs, next_value) - value, rho=rho)


def vtrace_loss(
    *,
    pi_head: nn.Module,
    pi_logits: Any,
    vpred: torch.Tensor,
    action: Any,
    behaviour_logprob: torch.Tensor,
    value_target: torch.Tensor,
    pg_delta: torch.Tensor,
    rho_bar: float,
    vf_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IMPALA's loss (§4.2), to minimise; ``vpred`` and ``value_target`` in the value head's units.

    Policy gradient ``rho_s grad log pi(a_s|x_s) (r_s + gamma v_{s+1} - V(x_s))`` with ``pg_delta``
    the bracket (computed once per iteration by ``vtrace``), value regression towards ``v_s``, and
    an entropy bonus. ``rho_s = min(rho_bar, pi/mu)`` is taken at the parameters being updated (no
    gradient through it): on an iteration's first step it is the weight ``vtrace`` used, and on
    later steps (more epochs, more micro-batches) the gradient stays the off-policy gradient at the
    current parameters. This is what keeps several epochs stable: an action pushed down below its
    behaviour probability gets a weight that shrinks with it, where a frozen weight would drive its
    log-probability down without bound (CartPole collapsed to a deterministic policy that way).
    """
    logprob = pi_head.logprob(action, pi_logits)
    rho = (logprob.detach() - behaviour_logprob.float()).exp().clamp(max=rho_bar)
    policy_loss = -(rho * pg_delta * logprob).mean()
    value_loss = 0.5 * ((vpred - value_target) ** 2).mean()
    entropy = pi_head.entropy(pi_logits).mean()
    loss = policy_loss + vf_coef * value_loss - entropy_coef * entropy
    stats = {"policy_loss": policy_loss.detach(), "value_loss": value_loss.detach(), "entropy": entropy.detach()}
    return loss, stats


class VTraceOptions(BaseModel):
    """``train_config`` keys of VTraceTrainer (beside the core's loop keys)."""

    model_config = ConfigDict(extra="forbid")

    rho_bar: float = Field(1.0, gt=0, description="V-trace truncation of the importance weight rho (IMPALA's rho-bar).")
    c_bar: float = Field(1.0, gt=0, description="V-trace truncation of the trace coefficients c (IMPALA's c-bar).")
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss towards the V-trace targets v_s.")
    entropy_bonus_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")


class VTraceTrainer(BaseTrainer):
    """IMPALA's actor-critic with V-trace targets computed once per iteration (APPO-style)."""

    name = "VTraceTrainer"
    Config = VTraceOptions

    @property
    def options(self) -> VTraceOptions:
        return getattr(self, "_options", None) or VTraceOptions()

    def setup_model_and_optimizer(self, policy: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        tc = self.train_config
        optimizer = torch.optim.AdamW(policy.parameters(), lr=tc.learning_rate, eps=tc.adam_eps, weight_decay=tc.weight_decay)
        return policy, optimizer

    @torch.no_grad()
    def estimate(self, *, batch: dict) -> dict:
        """Add ``value``, ``return`` (v_s), ``advantage`` (the §4.2 advantage), ``vtrace_rho`` and
        ``staleness`` to the batch, from the current network run over whole chunks."""
        tc, opts = self.train_config, self.options
        policy = unwrap(self.model)
        was_training = policy.training
        policy.eval()
        try:
            latents, state = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=tc.context_length)
            done_last = (batch[F.TERMINATED][:, -1:] | batch[F.TRUNCATED][:, -1:]).bool()
            next_latents, _ = policy(input=batch[F.NEXT_OBS], state_in=state, context={"first": done_last})
        finally:
            policy.train(was_training)
        value = denormalized_value(policy, latents["vpred"]).float()
        next_value = denormalized_value(policy, squeeze_value(next_latents["vpred"])).float()[:, 0]
        targets = vtrace(
            behaviour_logprob=batch[F.LOGPROB], target_logprob=policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"].float()),
            reward=batch[F.REWARD], value=value, next_value=next_value, terminated=batch[F.TERMINATED],
            truncated=batch[F.TRUNCATED], bootstrap=batch[F.BOOTSTRAP], discount=tc.discount,
            rho_bar=opts.rho_bar, c_bar=opts.c_bar,
        )  # fmt: skip
        batch[F.VALUE], batch[F.RETURN], batch[F.ADVANTAGE], batch[RHO] = value, targets.vs, targets.pg_advantage, targets.rho
        batch[PG_DELTA] = targets.pg_delta
        batch["staleness"] = (self.version - batch[F.VERSION]).float()
        if hasattr(policy.value_head, "update_normalizer"):
            policy.value_head.update_normalizer(self._all_gather(targets.vs))
        return batch

    def compute_loss(self, *, batch: dict, outputs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one window: ``batch`` columns and ``outputs`` (the policy's latents) are (B, W)."""
        opts, policy = self.options, unwrap(self.model)
        value_target, scale = batch[F.RETURN], 1.0
        if hasattr(policy.value_head, "normalize"):
            # The head regresses normalised targets; the policy gradient is taken in the same units
            # (the advantage divided by the normaliser's scale, as PopArt-IMPALA does, Hessel et al.
            # 2019), so one learning rate and entropy weight suit rewards of any size.
            value_target = policy.value_head.normalize(value_target)
            unit = torch.tensor([0.0, 1.0], device=value_target.device)
            scale = float(policy.value_head.denormalize(unit).diff())
        return vtrace_loss(
            pi_head=policy.pi_head, pi_logits=outputs["pi_logits"].float(),
            vpred=squeeze_value(outputs["vpred"]).float(), action=batch[F.ACTION], value_target=value_target,
            behaviour_logprob=batch[F.LOGPROB], pg_delta=batch[PG_DELTA] / scale, rho_bar=opts.rho_bar,
            vf_coef=opts.vf_coef, entropy_coef=opts.entropy_bonus_coef,
        )  # fmt: skip

    # -- until the core owns the update loop (issue 17): a plain driver of estimate + compute_loss --

    def train(self, batch: dict) -> dict[str, float]:
        tc = self.train_config
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        batch = self.estimate(batch=batch)
        n, per_batch, accum = batch[F.REWARD].shape[0], tc.batch_size_per_gpu, tc.gradient_accumulation
        num_batches = math.ceil(n / per_batch)
        totals = {k: 0.0 for k in METRICS}
        grad_norms: list[float] = []
        for _ in range(tc.epochs_per_iteration):
            order = torch.randperm(n)
            for b in range(num_batches):
                rows = order[b * per_batch : (b + 1) * per_batch]
                state = tree_index(batch[F.STATE_IN], rows)
                spans = windows(batch[F.REWARD].shape[1], tc.context_length)
                for window in spans:
                    part = {c: slice_time(tree_index(batch[c], rows), window) for c in (F.OBS, F.ACTION, F.FIRST, F.RETURN, F.LOGPROB, PG_DELTA)}
                    outputs, state_out = self.model(input=part[F.OBS], state_in=state, context={"first": part[F.FIRST]})
                    loss, stats = self.compute_loss(batch=part, outputs=outputs)
                    weight = (window.stop - window.start) / batch[F.REWARD].shape[1]
                    (loss * weight / accum).backward()
                    state = detach_state(state_out)
                    for k in METRICS:
                        totals[k] += float(stats[k]) * weight
                if (b + 1) % accum == 0 or b == num_batches - 1:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.max_grad_norm))
                    if self.update_is_finite(grad_norm=grad_norm, loss_terms=stats):
                        self.optimizer.step()
                        grad_norms.append(grad_norm)
                    self.optimizer.zero_grad(set_to_none=True)
        count = tc.epochs_per_iteration * num_batches
        metrics = {f"trainer/{k}": v / count for k, v in totals.items()}
        metrics["trainer/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics["trainer/vtrace_rho_mean"] = float(batch[RHO].mean())
        metrics["trainer/vtrace_rho_clipfrac"] = float((batch[RHO] >= self.options.rho_bar).float().mean())
        return metrics

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.world_size > 1 and dist.is_available() and dist.is_initialized()):
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(VTraceTrainer)
