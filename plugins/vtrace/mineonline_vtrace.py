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

from typing import Any, NamedTuple

import torch
from pydantic import Field
from torch import nn

import mineonline_core
from mineonline_core import Algorithm, TrainerOptions, unwrap
from mineonline_core.contracts.batch import Columns, ModelOutputs, Outputs, TrainBatch

# Batch columns added by VTraceTrainer.estimate, (N, L): the truncated importance weight rho_s of the
# network before the update, and r_s + gamma v_{s+1} - V(x_s) of the policy gradient.
RHO = "vtrace_rho"
PG_DELTA = "vtrace_pg_delta"


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


class VTraceOptions(TrainerOptions):
    """``train_config`` keys of VTraceTrainer, beside the core's loop keys."""

    rho_bar: float = Field(
        1.0,
        gt=0,
        description="V-trace truncation of the importance weight rho_t = min(rho_bar, pi/mu) (IMPALA's "
        "rho-bar): the fixed point of the value targets lies between the behaviour and the target policy's values, "
        "nearer pi the larger it is. A large value (1e9) turns the truncation off.",
    )
    c_bar: float = Field(
        1.0,
        gt=0,
        description="V-trace truncation of the trace coefficients c_i = min(c_bar, pi/mu) (IMPALA's c-bar): "
        "how far back along the chunk a temporal difference corrects a target; 0 gives one-step targets.",
    )
    vf_coef: float = Field(0.5, ge=0, description="Weight of the value loss towards the V-trace targets v_s.")
    entropy_bonus_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")


class VTraceTrainer(Algorithm):
    """IMPALA's actor-critic with V-trace targets computed once per iteration (APPO-style)."""

    name = "VTraceTrainer"
    Config = VTraceOptions

    @torch.no_grad()
    def estimate(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """Add ``value`` (V(x_s)), ``return`` (v_s, what the core's loop regresses the value head on),
        ``advantage`` (the §4.2 advantage), ``vtrace_rho`` and ``vtrace_pg_delta`` to the batch, from
        the current network run over whole chunks."""
        opts = self.options
        current = self.ctx.current_policy_outputs(batch=batch)
        targets = vtrace(
            behaviour_logprob=batch[Columns.LOGPROB],
            target_logprob=current["logprob"],
            reward=batch[Columns.REWARD],
            value=current["value"],
            next_value=current["next_value"],
            terminated=batch[Columns.TERMINATED],
            truncated=batch[Columns.TRUNCATED],
            bootstrap=batch[Columns.BOOTSTRAP],
            discount=self.ctx.train_config.discount,
            rho_bar=opts.rho_bar,
            c_bar=opts.c_bar,
        )
        batch[Columns.VALUE], batch[Columns.RETURN], batch[Columns.ADVANTAGE] = (
            current["value"],
            targets.vs,
            targets.pg_advantage,
        )
        batch[RHO], batch[PG_DELTA] = targets.rho, targets.pg_delta
        ratio = (current["logprob"] - batch[Columns.LOGPROB].float()).exp()
        self._rho_metrics = {
            "trainer/vtrace_rho_mean": float(targets.rho.mean()),
            "trainer/vtrace_rho_clipfrac": float((ratio > opts.rho_bar).float().mean()),
        }
        return batch

    def compute_loss(self, *, batch: TrainBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """IMPALA's loss over one window; the core's loop put ``value_target`` (v_s) in the value
        head's normalised units."""
        opts, policy = self.options, unwrap(self.ctx.model)
        return vtrace_loss(
            pi_head=policy.pi_head,
            pi_logits=outputs[Outputs.PI_LOGITS],
            vpred=outputs[Outputs.VPRED],
            action=batch[Columns.ACTION],
            behaviour_logprob=batch[Columns.LOGPROB],
            value_target=batch[Columns.VALUE_TARGET],
            pg_delta=batch[PG_DELTA] / _value_scale(policy),
            rho_bar=opts.rho_bar,
            vf_coef=opts.vf_coef,
            entropy_coef=opts.entropy_bonus_coef,
        )

    def iteration_metrics(self) -> dict[str, float]:
        return dict(getattr(self, "_rho_metrics", {}))


def _value_scale(policy: nn.Module) -> float:
    """How many return units one unit of the value head's output is (1 without a normaliser).

    The policy gradient is taken in the head's normalised units, as PopArt-IMPALA does (Hessel et al.
    2019), so one learning rate and entropy weight suit CartPole's returns and Crafter's alike."""
    head = policy.value_head
    if not hasattr(head, "denormalize"):
        return 1.0
    unit = torch.tensor([0.0, 1.0], device=next(head.parameters()).device)
    return float(head.denormalize(unit).diff())


@mineonline_core.hookimpl
def mineonline_register_trainers(register: Any) -> None:
    register(VTraceTrainer)
