"""One PPO iteration written plainly from the papers, to check the product's against (issue 34).

Schulman et al. 2017 (clipped surrogate, value loss, entropy bonus), Schulman et al. 2016 (GAE),
Hilton et al. 2021 (the decoupled objective: clip against the proximal policy, weight by the truncated
behaviour ratio), CleanRL's ``ppo.py`` for the optional value clip and the loop shape. It shares no code
with the product: only the policy module's ``forward`` is called (log-probs, entropy and KL are computed
here from its logits), and every sum is taken in float64, step by step, in plain loops.

What the product leaves to its own specification, written here from that specification (DESIGN.md,
the PPO plugin's module doc, the ``train_config`` field descriptions), not from its code:

* a step both terminated and truncated is a termination (DESIGN §5.2: GAE stops at a true terminal);
  a truncation (a time limit or an env crash) bootstraps from the stored ``bootstrap`` value;
* the value normaliser (OpenAI VPT's ``NormalizeEwma``): debiased EWMA of the returns and of their
  squares with the head's ``beta``; the debiasing weight floored at the head's ``epsilon``, the variance
  at 1e-2; updated once per iteration with every rank's returns, after the estimate (so the estimate's
  values are denormalised with the old statistics) and before the targets are normalised;
* full-batch advantage normalisation over every rank with the unbiased std, + 1e-8; the per-micro-batch
  option with the population std (the product's choice, which its docs leave open);
* one optimiser step per ``gradient_accumulation`` micro-batches (a last partial group too), each
  micro-batch's loss divided by its group's size and each BPTT window's by L / its length; DDP averages
  gradients over ranks; gradients are filtered (value-head-only warm-up) before the global norm is
  clipped, and the logged ``grad_norm`` is the mean over the iteration's steps of the norm before clipping;
* metrics are per rank: each window's mean weighted by its length / L, summed over the micro-batches
  and divided by ``epochs * micro-batches``.

The random micro-batch order: the product draws ``torch.randperm(n)`` from torch's global generator once
per epoch. The test seeds that generator (``permutation_seed``) right before the product's iteration,
and the reference draws its permutations from a ``torch.Generator`` seeded the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as Fn


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Every coefficient of one iteration, by its meaning (the test maps them to ``train_config``)."""

    discount: float
    gae_lambda: float
    clip: float
    behaviour_weight_clip: float
    log_ratio_range: float
    clip_vloss: bool
    policy_coef: float
    vf_coef: float
    entropy_coef: float
    rho0: float
    rho_decay: float
    vf_warmup: int
    value_head_only: bool
    normalize_full: bool
    normalize_minibatch: bool
    normalized_vf: bool
    learning_rate: float
    anneal_lr: bool
    num_iterations: int
    weight_decay: float
    adam_eps: float
    max_grad_norm: float
    batch_size: int
    accumulation: int
    epochs: int
    context_length: int


def _step(policy: nn.Module, obs: torch.Tensor, state: Any, first: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
    """One time step of every row: float64 log-probs (B, A), value (B,), next state."""
    latents, state = policy(input={"obs": obs}, state_in=state, context={"first": first})
    logp = Fn.log_softmax(latents["pi_logits"][:, 0].double(), dim=-1)
    return logp, latents["vpred"].reshape(obs.shape[0]).double(), state


def _rows(state: Any, rows: torch.Tensor) -> Any:
    return None if state is None else [s[rows] for s in state]


def _detached(state: Any) -> Any:
    return None if state is None else [s.detach() for s in state]


class Normaliser:
    """The value head's running statistics, held and updated here in float64."""

    def __init__(self, head: nn.Module) -> None:
        self.enabled = bool(head.use_normalizer)
        self.beta, self.epsilon = float(head.normalizer.beta), float(head.normalizer.epsilon)
        self.mean_acc = float(head.normalizer.running_mean[0])
        self.sq_acc = float(head.normalizer.running_mean_sq[0])
        self.weight = float(head.normalizer.debiasing_term)

    def mean_std(self) -> tuple[float, float]:
        weight = max(self.weight, self.epsilon)
        mean = self.mean_acc / weight
        return mean, math.sqrt(max(self.sq_acc / weight - mean * mean, 1e-2))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean_std()
        return (x - mean) / std if self.enabled else x

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.mean_std()
        return x * std + mean if self.enabled else x

    def update(self, returns: torch.Tensor, head: nn.Module) -> None:
        if not self.enabled:
            return
        b = self.beta
        self.mean_acc = b * self.mean_acc + (1 - b) * float(returns.mean())
        self.sq_acc = b * self.sq_acc + (1 - b) * float((returns**2).mean())
        self.weight = b * self.weight + (1 - b)
        with torch.no_grad():  # the statistics live in the policy's state dict, compared with the product's
            head.normalizer.running_mean.fill_(self.mean_acc)
            head.normalizer.running_mean_sq.fill_(self.sq_acc)
            head.normalizer.debiasing_term.fill_(self.weight)


def gae(data: dict, value: torch.Tensor, next_value: torch.Tensor, *, discount: float, lam: float) -> torch.Tensor:
    """Advantages (N, L), one step at a time backwards."""
    n, length = value.shape
    advantage = torch.zeros(n, length, dtype=torch.float64)
    for i in range(n):
        running = 0.0
        for t in reversed(range(length)):
            if bool(data["terminated"][i, t]):  # a true terminal, even when also truncated
                following, same_episode = 0.0, 0.0
            elif bool(data["truncated"][i, t]):  # cut: bootstrap, and the next step is another episode
                following, same_episode = float(data["bootstrap"][i, t]), 0.0
            else:
                following = float(value[i, t + 1]) if t + 1 < length else float(next_value[i])
                same_episode = 1.0
            delta = float(data["reward"][i, t]) + discount * following - float(value[i, t])
            running = delta + discount * lam * same_episode * running
            advantage[i, t] = running
    return advantage


class PPOReference:
    """Holds its own copy of the policy and optimiser; ``iteration`` trains it like the product's."""

    def __init__(self, *, policy: nn.Module, reference: nn.Module | None, settings: Settings) -> None:
        self.policy, self.reference, self.s = policy, reference, settings
        params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=settings.learning_rate, eps=settings.adam_eps, weight_decay=settings.weight_decay
        )
        self.normaliser = Normaliser(policy.value_head)

    @torch.no_grad()
    def estimate(self, data: dict) -> dict[str, torch.Tensor]:
        """The current policy over each chunk from its stored state, one step at a time."""
        n, length = data["reward"].shape
        logp_prox = torch.zeros(n, length, dtype=torch.float64)
        vpred = torch.zeros(n, length, dtype=torch.float64)
        state = data["state_in"]
        for t in range(length):
            logp, v, state = _step(self.policy, data["obs"][:, t : t + 1], state, data["first"][:, t : t + 1])
            logp_prox[:, t] = logp.gather(1, data["action"][:, t : t + 1].long())[:, 0]
            vpred[:, t] = v
        ended = (data["terminated"][:, -1:] | data["truncated"][:, -1:]).bool()
        _, next_vpred, _ = _step(self.policy, data["next_obs"], state, ended)
        return {
            "logp_prox": logp_prox,
            "old_vpred": vpred,
            "value": self.normaliser.denormalize(vpred),
            "next_value": self.normaliser.denormalize(next_vpred),
        }

    def iteration(self, *, iteration: int, version: int, ranks: list[dict], permutation_seeds: list[int]) -> list:
        """Train on every rank's data; returns each rank's ``trainer/*`` metrics and their scales."""
        s = self.s
        lr = s.learning_rate * (1 - (iteration - 1) / s.num_iterations) if s.anneal_lr else s.learning_rate
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rho = s.rho0 * s.rho_decay ** (iteration - 1)
        warmup = iteration <= s.vf_warmup
        use_reference = self.reference is not None and (rho > 0 or warmup)
        prepared = []
        for data in ranks:
            est = self.estimate(data)
            advantage = gae(data, est["value"], est["next_value"], discount=s.discount, lam=s.gae_lambda)
            prepared.append({**data, **est, "advantage": advantage, "return": advantage + est["value"]})
        if s.normalized_vf:
            self.normaliser.update(torch.cat([p["return"].reshape(-1) for p in prepared]), self.policy.value_head)
        for p in prepared:
            p["value_target"] = self.normaliser.normalize(p["return"])
        if s.normalize_full:
            every = torch.cat([p["advantage"].reshape(-1) for p in prepared])
            mean, std = every.mean(), every.std(correction=1)
            for p in prepared:
                p["advantage"] = (p["advantage"] - mean) / (std + 1e-8)
        n = prepared[0]["reward"].shape[0]
        num_batches = math.ceil(n / s.batch_size)
        generators = [torch.Generator().manual_seed(seed) for seed in permutation_seeds]
        totals: list[dict[str, float]] = [{} for _ in ranks]
        grad_norms: list[float] = []
        for _ in range(s.epochs):
            orders = [torch.randperm(n, generator=g) for g in generators]
            for b in range(num_batches):
                group_start = b - b % s.accumulation
                group_size = min(s.accumulation, num_batches - group_start)
                for r, p in enumerate(prepared):
                    rows = orders[r][b * s.batch_size : (b + 1) * s.batch_size]
                    terms = self._micro_batch(
                        p,
                        rows,
                        rho=rho,
                        warmup=warmup,
                        use_reference=use_reference,
                        scale=1.0 / (group_size * len(ranks)),
                    )
                    for key, value in terms.items():
                        totals[r][key] = totals[r].get(key, 0.0) + value
                if (b + 1) % s.accumulation == 0 or b == num_batches - 1:
                    grad_norms.append(self._optimizer_step(warmup))
        out = []
        for r, p in enumerate(prepared):
            count = s.epochs * num_batches
            metrics = {f"trainer/{k}": v / count for k, v in totals[r].items()}
            metrics["trainer/grad_norm"] = sum(grad_norms) / len(grad_norms)
            unexplained = (p["return"] - p["value"]).var(correction=1)
            metrics["trainer/explained_variance"] = float(1 - unexplained / max(float(p["return"].var()), 1e-8))
            metrics.update(
                {
                    "trainer/rho": rho,
                    "trainer/vf_warmup": float(warmup),
                    "trainer/value_only": float(warmup and s.value_head_only),
                    "trainer/learning_rate": lr,
                    "trainer/staleness_mean": float((version - p["version"]).double().mean()),
                    "trainer/iteration": float(iteration),
                    "trainer/version": float(version + (0 if warmup else 1)),
                    "trainer/skipped_updates": 0.0,
                    "trainer/skipped_updates_total": 0.0,
                }
            )
            out.append(metrics)
        return out

    def _micro_batch(
        self, p: dict, rows: torch.Tensor, *, rho: float, warmup: bool, use_reference: bool, scale: float
    ) -> dict[str, float]:
        """Backward over one micro-batch, window by window; returns its length-weighted metric sums."""
        s = self.s
        length = p["reward"].shape[1]
        advantage = p["advantage"][rows]
        if s.normalize_minibatch:
            advantage = (advantage - advantage.mean()) / (advantage.std(correction=0) + 1e-8)
        state, ref_state = _rows(p["state_in"], rows), _rows(p["ref_state_in"], rows)
        sums: dict[str, float] = {}
        for start in range(0, length, s.context_length):
            stop = min(start + s.context_length, length)
            logps, values, ref_logps = [], [], []
            for t in range(start, stop):
                obs, first = p["obs"][rows, t : t + 1], p["first"][rows, t : t + 1]
                logp, v, state = _step(self.policy, obs, state, first)
                logps.append(logp)
                values.append(v)
                if use_reference:
                    with torch.no_grad():
                        ref_logp, _, ref_state = _step(self.reference, obs, ref_state, first)
                    ref_logps.append(ref_logp)
            state = _detached(state)  # truncated BPTT: no gradient across a window boundary
            logp_all = torch.stack(logps, 1)  # (B, W, A)
            vpred = torch.stack(values, 1)
            window = slice(start, stop)
            action = p["action"][rows, window].long()
            logp_new = logp_all.gather(2, action[..., None])[..., 0]
            logp_prox, logp_mu = p["logp_prox"][rows, window], p["logprob"][rows, window].double()
            adv = advantage[:, window]
            bound = s.log_ratio_range
            log_ratio = (logp_new - logp_prox).clamp(-bound, bound)
            ratio = torch.exp(log_ratio)
            log_w = (logp_prox - logp_mu).clamp(-bound, bound)
            w_raw = torch.exp(log_w)
            w = torch.clamp(w_raw, max=s.behaviour_weight_clip)
            surrogate = w * torch.minimum(ratio * adv, torch.clamp(ratio, 1 - s.clip, 1 + s.clip) * adv)
            policy_loss = -surrogate.mean()
            target, old = p["value_target"][rows, window], p["old_vpred"][rows, window]
            squared = (vpred - target) ** 2
            if s.clip_vloss:
                clipped = old + torch.clamp(vpred - old, -s.clip, s.clip)
                squared = torch.maximum(squared, (clipped - target) ** 2)
            value_loss = 0.5 * squared.mean()
            probs = logp_all.exp()
            entropy = -(probs * logp_all).sum(-1).mean()
            if use_reference:
                ref_logp_all = torch.stack(ref_logps, 1)
                kl_ref = (probs * (logp_all - ref_logp_all)).sum(-1).mean()
                kl_scale = float((probs * (logp_all.abs() + ref_logp_all.abs())).sum(-1).mean().detach())
            else:
                kl_ref, kl_scale = torch.zeros((), dtype=torch.float64), 0.0
            if warmup:
                loss = s.vf_coef * value_loss + kl_ref
            else:
                loss = s.policy_coef * policy_loss - s.entropy_coef * entropy + s.vf_coef * value_loss + rho * kl_ref
            fraction = (stop - start) / length
            (loss * fraction * scale).backward()
            with torch.no_grad():
                terms = {
                    "policy_loss": float(policy_loss),
                    "value_loss": float(value_loss),
                    "entropy": float(entropy),
                    "kl_ref": float(kl_ref),
                    "approx_kl": float((ratio - 1 - log_ratio).mean()),
                    "clipfrac": float(((ratio - 1).abs() > s.clip).double().mean()),
                    "ratio_deviation": float((ratio - 1).abs().max()),
                    "behaviour_weight_mean": float(w.mean()),
                    "behaviour_weight_clipfrac": float((w_raw > s.behaviour_weight_clip).double().mean()),
                    "behaviour_kl": float((w_raw - 1 - log_w).mean()),
                    # The size of what each metric is computed from, for the comparison's tolerance.
                    "scale/policy_loss": float(surrogate.abs().mean()),
                    "scale/value_loss": float(0.5 * (vpred**2 + target**2 + old**2).mean()),
                    "scale/kl_ref": kl_scale,
                }
            for key, value in terms.items():
                sums[key] = sums.get(key, 0.0) + value * fraction
        return sums

    def _optimizer_step(self, warmup: bool) -> float:
        s = self.s
        params = [p for p in self.policy.parameters() if p.requires_grad]
        for param in params:
            # Every trainable parameter takes part in the step (so AdamW decays it) even where the loss
            # does not reach it (the policy head in a whole-model warm-up): "every parameter is updated".
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        if warmup and s.value_head_only:
            keep = {id(p) for p in self.policy.value_head.parameters()}
            for param in params:
                if id(param) not in keep:
                    param.grad = None
        grads = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        if norm > s.max_grad_norm:
            for g in grads:
                g.mul_(s.max_grad_norm / (norm + 1e-6))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
