"""A plain V-trace actor-critic iteration, written from Espeholt et al. 2018 (IMPALA) for the oracle tests.

It shares nothing with the product but the policy module (its forward, ``pi_head.logprob`` and
``pi_head.entropy``): the targets are eq. (1) summed term by term (not the product's recursion), the
value normaliser, gradient clipping and AdamW are written out here, and every loop is explicit.

The iteration it reproduces (APPO-style, as the product documents it): the targets are computed once,
before the update, by the network as it is then, each chunk stepped one step at a time from its stored
recurrent state; the value normaliser is then updated with the targets; the update walks the chunks in
micro-batches (a seeded permutation per epoch), each chunk cut into ``context_length`` windows whose
recurrent state is carried and detached between windows (truncated BPTT), sums the gradients of
``accumulation`` micro-batches, clips their global norm and takes one AdamW step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OracleSettings:
    discount: float
    rho_bar: float
    c_bar: float
    vf_coef: float
    entropy_coef: float
    learning_rate: float
    anneal_lr: bool
    num_iterations: int
    weight_decay: float
    adam_eps: float
    max_grad_norm: float
    epochs: int
    batch_size: int
    accumulation: int
    context_length: int
    normalizer_beta: float


class ReferenceNormalizer:
    """Debiased exponentially weighted mean and variance of the returns (VPT's value normaliser)."""

    def __init__(self, *, mean: float, mean_sq: float, debias: float, beta: float) -> None:
        self.mean_acc, self.sq_acc, self.debias, self.beta = mean, mean_sq, debias, beta

    def stats(self) -> tuple[float, float]:
        d = max(self.debias, 1e-5)
        mean = self.mean_acc / d
        var = max(self.sq_acc / d - mean * mean, 1e-2)
        return mean, math.sqrt(var)

    def update(self, returns: torch.Tensor) -> None:
        x = returns.double().flatten()
        self.mean_acc = self.beta * self.mean_acc + (1 - self.beta) * float(x.mean())
        self.sq_acc = self.beta * self.sq_acc + (1 - self.beta) * float((x * x).mean())
        self.debias = self.beta * self.debias + (1 - self.beta)


def vtrace_targets_eq1(
    *,
    mu_logprob: list[float],
    pi_logprob: list[float],
    reward: list[float],
    value: list[float],
    value_after_chunk: float,
    terminated: list[bool],
    truncated: list[bool],
    bootstrap: list[float],
    gamma: float,
    rho_bar: float,
    c_bar: float,
) -> tuple[list[float], list[float], list[float]]:
    """One chunk: (v_s, the §4.2 bracket r_s + gamma v_{s+1} - V(x_s), rho_s), in float64.

    V(x_{t+1}) is the next step's value inside an episode, 0 after a true terminal (even when the step
    is also marked truncated), the stored bootstrap after a truncation, and the value after the chunk at
    its last step; the sum of eq. (1) stops at the end of the episode or of the chunk."""
    length = len(reward)
    ratio = [math.exp(pi_logprob[t] - mu_logprob[t]) for t in range(length)]
    rho = [min(rho_bar, r) for r in ratio]
    c = [min(c_bar, r) for r in ratio]
    ends = [terminated[t] or truncated[t] for t in range(length)]

    def value_next(t: int, values: list[float], last: float) -> float:
        if terminated[t]:
            return 0.0
        if truncated[t]:
            return bootstrap[t]
        return values[t + 1] if t + 1 < length else last

    delta = [rho[t] * (reward[t] + gamma * value_next(t, value, value_after_chunk) - value[t]) for t in range(length)]
    vs = []
    for s in range(length):
        total, t, trace = 0.0, s, 1.0
        while True:
            total += gamma ** (t - s) * trace * delta[t]
            if ends[t] or t + 1 == length:
                break
            trace *= c[t]
            t += 1
        vs.append(value[s] + total)
    bracket = [reward[s] + gamma * value_next(s, vs, value_after_chunk) - value[s] for s in range(length)]
    return vs, bracket, rho


class VTraceOracle:
    """Owns a copy of the policy and an AdamW state of its own; ``iteration`` updates both."""

    def __init__(self, *, policy: nn.Module, settings: OracleSettings) -> None:
        self.policy, self.s = policy, settings
        norm = policy.value_head.normalizer
        self.normalizer = ReferenceNormalizer(
            mean=float(norm.running_mean[0]),
            mean_sq=float(norm.running_mean_sq[0]),
            debias=float(norm.debiasing_term),
            beta=settings.normalizer_beta,
        )
        self.params = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
        self.adam = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in self.params}
        self.steps = 0

    # -- the policy, one step at a time --------------------------------------------------------

    @torch.no_grad()
    def _step_through(self, batch: dict, row: int) -> tuple[list[float], list[float], float]:
        """Log-probs of the stored actions and normalised values along one chunk, and the normalised
        value of the observation after it."""
        state = [h[row : row + 1] for h in batch["state_in"]]
        logps, vpreds = [], []
        length = batch["reward"].shape[1]
        for t in range(length):
            obs = {"obs": batch["obs"]["obs"][row : row + 1, t : t + 1]}
            first = batch["first"][row : row + 1, t : t + 1]
            latents, state = self.policy(input=obs, state_in=state, context={"first": first})
            action = batch["action"][row : row + 1, t : t + 1]
            logps.append(float(self.policy.pi_head.logprob(action, latents["pi_logits"])[0, 0]))
            vpreds.append(float(latents["vpred"].reshape(-1)[0]))
        ended = bool(batch["terminated"][row, -1] or batch["truncated"][row, -1])
        first = torch.tensor([[ended]])
        latents, _ = self.policy(
            input={"obs": batch["next_obs"]["obs"][row : row + 1]}, state_in=state, context={"first": first}
        )
        return logps, vpreds, float(latents["vpred"].reshape(-1)[0])

    # -- one iteration ---------------------------------------------------------------------------

    def iteration(self, batch: dict, *, iteration: int, version: int) -> dict[str, float]:
        s = self.s
        n, _length = batch["reward"].shape
        mean, std = self.normalizer.stats()
        vs, brackets, rho, values, logp_pi = [], [], [], [], []
        for row in range(n):
            logps, vpreds, after = self._step_through(batch, row)
            value = [v * std + mean for v in vpreds]
            chunk_vs, chunk_bracket, chunk_rho = vtrace_targets_eq1(
                mu_logprob=batch["logprob"][row].double().tolist(),
                pi_logprob=logps,
                reward=batch["reward"][row].double().tolist(),
                value=value,
                value_after_chunk=after * std + mean,
                terminated=batch["terminated"][row].tolist(),
                truncated=batch["truncated"][row].tolist(),
                bootstrap=batch["bootstrap"][row].double().tolist(),
                gamma=s.discount,
                rho_bar=s.rho_bar,
                c_bar=s.c_bar,
            )
            vs.append(chunk_vs), brackets.append(chunk_bracket), rho.append(chunk_rho), values.append(value)
            logp_pi.append(logps)
        vs_t, values_t = torch.tensor(vs, dtype=torch.float64), torch.tensor(values, dtype=torch.float64)
        bracket_t, rho_t = torch.tensor(brackets, dtype=torch.float64), torch.tensor(rho, dtype=torch.float64)
        ratio = (torch.tensor(logp_pi, dtype=torch.float64) - batch["logprob"].double()).exp()
        self.targets = {
            "vs": vs_t,
            "advantage": rho_t * bracket_t,
            "bracket": bracket_t,
            "rho": rho_t,
            "value": values_t,
        }
        metrics = {
            "trainer/vtrace_rho_mean": float(rho_t.mean()),
            "trainer/vtrace_rho_clipfrac": float((ratio > s.rho_bar).double().mean()),
            "trainer/explained_variance": 1.0 - float(torch.var(vs_t - values_t) / torch.var(vs_t)),
            "trainer/staleness_mean": float((version - batch["version"]).double().mean()),
            "trainer/iteration": float(iteration),
            "trainer/version": float(version + 1),
        }
        self.normalizer.update(vs_t)
        mean, std = self.normalizer.stats()
        # The policy-gradient bracket r_s + gamma v_{s+1} - V(x_s) in the value head's units.
        bracket = bracket_t / std
        target = (vs_t - mean) / std
        lr = s.learning_rate * (1 - (iteration - 1) / s.num_iterations) if s.anneal_lr else s.learning_rate
        metrics["trainer/learning_rate"] = lr
        metrics.update(self._optimise(batch, bracket.float(), target.float(), lr))
        return metrics

    def _optimise(self, batch: dict, bracket: torch.Tensor, target: torch.Tensor, lr: float) -> dict[str, float]:
        s = self.s
        n, _length = batch["reward"].shape
        num_batches = -(-n // s.batch_size)
        sums = {"trainer/policy_loss": 0.0, "trainer/value_loss": 0.0, "trainer/entropy": 0.0}
        norms = []
        for _ in range(s.epochs):
            order = torch.randperm(n)
            for b in range(num_batches):
                rows = order[b * s.batch_size : (b + 1) * s.batch_size]
                group_first = b - b % s.accumulation
                group_size = min(s.accumulation, num_batches - group_first)
                for key, value in self._backward(batch, rows, bracket, target, 1.0 / group_size).items():
                    sums[key] += value
                if b % s.accumulation == s.accumulation - 1 or b == num_batches - 1:
                    norms.append(self._clip_and_step(lr))
        out = {key: value / (s.epochs * num_batches) for key, value in sums.items()}
        out["trainer/grad_norm"] = sum(norms) / len(norms)
        return out

    def _backward(self, batch: dict, rows, bracket, target, scale: float) -> dict[str, float]:
        s = self.s
        length = batch["reward"].shape[1]
        state = [h[rows] for h in batch["state_in"]]
        stats = {"trainer/policy_loss": 0.0, "trainer/value_loss": 0.0, "trainer/entropy": 0.0}
        for start in range(0, length, s.context_length):
            w = slice(start, min(start + s.context_length, length))
            latents, state_out = self.policy(
                input={"obs": batch["obs"]["obs"][rows, w]}, state_in=state, context={"first": batch["first"][rows, w]}
            )
            logp = self.policy.pi_head.logprob(batch["action"][rows, w], latents["pi_logits"])
            rho_now = torch.clamp((logp.detach() - batch["logprob"][rows, w]).exp(), max=s.rho_bar)
            policy_loss = -(rho_now * bracket[rows, w] * logp).mean()
            value_loss = 0.5 * ((latents["vpred"].reshape(logp.shape) - target[rows, w]) ** 2).mean()
            entropy = self.policy.pi_head.entropy(latents["pi_logits"]).mean()
            loss = policy_loss + s.vf_coef * value_loss - s.entropy_coef * entropy
            share = (w.stop - w.start) / length
            (loss * share * scale).backward()
            state = [h.detach() for h in state_out]
            for key, term in (("policy_loss", policy_loss), ("value_loss", value_loss), ("entropy", entropy)):
                stats[f"trainer/{key}"] += float(term.detach()) * share
        return stats

    @torch.no_grad()
    def _clip_and_step(self, lr: float) -> float:
        s = self.s
        grads = [(name, p, p.grad) for name, p in self.params if p.grad is not None]
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for _, _, g in grads))
        coef = min(1.0, s.max_grad_norm / (norm + 1e-6))
        self.steps += 1
        beta1, beta2 = 0.9, 0.999
        for name, p, g in grads:
            g = g * coef
            m, v = self.adam[name]
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            m_hat = m / (1 - beta1**self.steps)
            v_hat = v / (1 - beta2**self.steps)
            p.mul_(1 - lr * s.weight_decay)
            p.sub_(lr * m_hat / (v_hat.sqrt() + s.adam_eps))
            p.grad = None
        return norm
