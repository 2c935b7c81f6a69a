"""The policy contract (MineStudio ``MinePolicy``-compatible) and reusable heads.

A policy is a ``torch.nn.Module`` that maps batched inputs (B, T, ...) and a recurrent state to
``latents`` and a new state::

    latents, state_out = policy(input={"image": uint8 (B,T,H,W,C)}, state_in=state,
                                context={"first": bool (B,T)})
    latents["pi_logits"]  # whatever ``policy.pi_head`` reads: log-probs, or a Gaussian's mean and log-std
    latents["vpred"]      # (B,T,1) or (B,T): the value, normalised when the head normalises

``first[b, t]`` marks the first step of an episode; a recurrent policy must reset its memory there,
at any t, so that a training forward over a fragment reproduces the step-by-step rollout.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.nn import functional as F

from mineonline_core.errors import ConfigError


class PolicyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Policy(nn.Module):
    """Base class of registered policies. Subclasses set ``pi_head`` and ``value_head``."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = PolicyOptions
    #: Whether the forward is safe under float16 autocast (``train_config.amp_dtype: float16``):
    #: no constant or activation beyond float16's 65504 (mask fills from ``torch.finfo``). bfloat16
    #: has float32's range and needs no declaration.
    supports_float16: ClassVar[bool] = False

    @classmethod
    def build(cls, options: BaseModel, *, observation_space: Any, action_space: Any) -> "Policy":
        """Build the policy from its validated options and the env's spaces."""
        raise NotImplementedError

    def initial_state(self, batch_size: int) -> Any:
        """The recurrent state before an episode's first step; None for a feed-forward policy."""
        return None

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        raise NotImplementedError


class EwmaNormalizer(nn.Module):
    """Exponentially weighted running mean/variance, debiased (OpenAI VPT's ``NormalizeEwma``).

    The statistics are non-trainable parameters so that they live in the state dict, the weight
    broadcast and the checkpoint.
    """

    def __init__(self, size: int = 1, *, beta: float = 0.99999, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.beta, self.epsilon = beta, epsilon
        self.running_mean = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.running_mean_sq = nn.Parameter(torch.zeros(size), requires_grad=False)
        self.debiasing_term = nn.Parameter(torch.tensor(0.0), requires_grad=False)

    def mean_var(self) -> tuple[torch.Tensor, torch.Tensor]:
        debias = self.debiasing_term.clamp(min=self.epsilon)
        mean = self.running_mean / debias
        var = (self.running_mean_sq / debias - mean**2).clamp(min=1e-2)
        return mean, var

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.mean_var()
        return (x - mean) / var.sqrt()

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, var = self.mean_var()
        return x * var.sqrt() + mean

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1, self.running_mean.shape[0])
        w = self.beta
        self.running_mean.mul_(w).add_(x.mean(0) * (1 - w))
        self.running_mean_sq.mul_(w).add_((x**2).mean(0) * (1 - w))
        self.debiasing_term.mul_(w).add_(1 - w)


class ValueHead(nn.Module):
    """A linear value head whose output is normalised by an ``EwmaNormalizer``.

    ``vpred`` is the normalised value; ``denormalize`` gives returns. With ``normalize=False`` the
    normaliser is the identity and training targets are raw returns.
    """

    def __init__(self, in_features: int, *, normalize: bool = True, beta: float = 0.99999) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 1)
        self.normalizer = EwmaNormalizer(1, beta=beta)
        self.use_normalizer = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def reset_parameters(self) -> None:
        """Zero the output layer, so the initial value is the normaliser's mean (``zero_initial_vf``)."""
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalizer.normalize(x) if self.use_normalizer else x

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalizer.denormalize(x) if self.use_normalizer else x

    def update_normalizer(self, returns: torch.Tensor) -> None:
        if self.use_normalizer:
            self.normalizer.update(returns)


class CategoricalHead(nn.Module):
    """A discrete action head: ``pi_logits`` are log-probs (B, T, n); actions are int64 (B, T)."""

    def __init__(self, in_features: int, n: int, *, temperature: float = 1.0) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, n)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.linear(x) / self.temperature, dim=-1)

    def sample(self, logits: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        if deterministic:
            return logits.argmax(-1)
        u = torch.rand_like(logits).clamp_(1e-20, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1)

    def logprob(self, action: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return -(logits.exp() * logits).sum(-1)

    def kl_divergence(self, logits_q: torch.Tensor, logits_p: torch.Tensor) -> torch.Tensor:
        """KL(q || p) for log-prob tensors of the same shape."""
        return (logits_q.exp() * (logits_q - logits_p)).sum(-1)


class MultiCategoricalHead(nn.Module):
    """One categorical per dimension of a ``MultiDiscrete`` space: ``pi_logits`` (B, T, sum(nvec)) are the
    dimensions' log-probs side by side; actions are int64 (B, T, len(nvec)).

    Each dimension's log-probs are normalised on their own, so the entropy and the KL of the joint (the
    dimensions are independent) are the categorical formulas summed over the whole last axis."""

    def __init__(self, in_features: int, nvec: list[int], *, temperature: float = 1.0) -> None:
        super().__init__()
        self.nvec = [int(n) for n in nvec]
        self.linear = nn.Linear(in_features, sum(self.nvec))
        self.temperature = temperature
        # Where each dimension's log-probs start on the last axis.
        self.register_buffer("offsets", torch.tensor([0, *self.nvec[:-1]]).cumsum(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = (self.linear(x) / self.temperature).split(self.nvec, dim=-1)
        return torch.cat([F.log_softmax(part, dim=-1) for part in parts], dim=-1)

    def sample(self, logits: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        if not deterministic:
            u = torch.rand_like(logits).clamp_(1e-20, 1.0)
            logits = logits - torch.log(-torch.log(u))
        return torch.stack([part.argmax(-1) for part in logits.split(self.nvec, dim=-1)], dim=-1)

    def logprob(self, action: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        index = action.long() + self.offsets.to(logits.device)
        return logits.gather(-1, index).sum(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        return -(logits.exp() * logits).sum(-1)

    def kl_divergence(self, logits_q: torch.Tensor, logits_p: torch.Tensor) -> torch.Tensor:
        """KL(q || p), summed over the dimensions."""
        return (logits_q.exp() * (logits_q - logits_p)).sum(-1)


class GaussianHead(nn.Module):
    """A diagonal Gaussian over a ``Box`` of ``dim`` values: ``pi_logits`` (B, T, 2 * dim) are the mean and
    the log standard deviation side by side; actions are float32 (B, T, dim).

    The log-std is a parameter, the same in every state (PPO's reference implementation for MuJoCo), so
    exploration shrinks only as training lowers it; it starts at ``init_log_std`` (0: unit std). Samples are
    not squashed: the env receives them clipped to its bounds, the fragment keeps them as sampled
    (``clip_action``, ``contracts/envs.py``). Densities are computed in float32 whatever the autocast."""

    def __init__(self, in_features: int, dim: int, *, init_log_std: float = 0.0) -> None:
        super().__init__()
        self.dim = int(dim)
        self.linear = nn.Linear(in_features, self.dim)
        self.log_std = nn.Parameter(torch.full((self.dim,), float(init_log_std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.linear(x)
        return torch.cat([mean, self.log_std.to(mean.dtype).expand_as(mean)], dim=-1)

    def _split(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = logits.float().split(self.dim, dim=-1)
        return mean, log_std

    def sample(self, logits: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        mean, log_std = self._split(logits)
        return mean if deterministic else mean + log_std.exp() * torch.randn_like(mean)

    def logprob(self, action: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        mean, log_std = self._split(logits)
        z = (action.float() - mean) * torch.exp(-log_std)
        return (-0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self, logits: torch.Tensor) -> torch.Tensor:
        _, log_std = self._split(logits)
        return (log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum(-1)

    def kl_divergence(self, logits_q: torch.Tensor, logits_p: torch.Tensor) -> torch.Tensor:
        """KL(q || p) of two diagonal Gaussians, in closed form, summed over the dimensions."""
        mean_q, log_std_q = self._split(logits_q)
        mean_p, log_std_p = self._split(logits_p)
        ratio = torch.exp(2 * (log_std_q - log_std_p)) + ((mean_q - mean_p) * torch.exp(-log_std_p)) ** 2
        return (log_std_p - log_std_q + 0.5 * (ratio - 1.0)).sum(-1)


def prepare_policy(policy: nn.Module, *, use_normalized_vf: bool) -> nn.Module:
    """Apply the run-wide policy settings that every process building a policy must agree on.

    Rollout workers and trainer ranks both call this on what ``policy_generator()`` returns, so the
    behaviour values they record and the values the trainer regresses are on the same scale.
    """
    refuse_minestudio_policy(policy)
    value_head = getattr(policy, "value_head", None)
    if value_head is not None and hasattr(value_head, "use_normalizer"):
        value_head.use_normalizer = use_normalized_vf
    return policy


def refuse_minestudio_policy(policy: nn.Module) -> None:
    """MineStudio's own policy classes (``minestudio.models``, 1.1.6) break the framework's guarantees
    (``docs/architecture.md``, "What the framework guarantees")."""
    cls = type(policy)
    if not cls.__module__.startswith("minestudio."):
        return
    raise ConfigError(
        f"policy_generator returned {cls.__module__}.{cls.__qualname__}, a MineStudio policy class, with which "
        f"mineonline cannot keep its guarantees (docs/architecture.md, 'What the framework guarantees'): (1) its forward ignores context['first'] "
        f"(MineStudio 1.1.6 passes first=False), so training would not reset the recurrent state at the episode "
        f"starts inside a fragment as rollout did, and the training forward would not reproduce the rollout's "
        f"log-probs; (2) its value head's EWMA normaliser updates its statistics on every normalize() call made "
        f"in training mode, whatever the values (behaviour values included), not once per batch of returns; "
        f"(3) initial_state returns one cached list of "
        f"tensors per batch size, shared by every caller (aliased across envs with num_envs=1). Fix: load the "
        f"same .model/.weights files with mineonline_vpt.load_vpt_policy(model_path, weights_path) (the vpt "
        f"plugin: the same architecture and state-dict keys, loaded strictly, honouring 'first'), or set "
        f"policy_config: {{name: vpt, model_path: ..., weights_path: ...}}."
    )


def state_dict_mismatch(module: nn.Module, state: dict, *, limit: int = 8) -> str | None:
    """Describe how ``state`` fails to fit ``module``: missing, unexpected and mis-shaped keys, or None."""
    expected = module.state_dict()

    def listing(keys: list[str]) -> str:
        return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")

    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    misshaped = [
        f"{k} (file {tuple(state[k].shape)}, model {tuple(expected[k].shape)})"
        for k in expected
        if k in state and tuple(state[k].shape) != tuple(expected[k].shape)
    ]
    parts = [
        f"{what}: {listing(keys)}"
        for what, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("mis-shaped keys", misshaped))
        if keys
    ]
    return "; ".join(parts) or None


@torch.no_grad()
def zero_value_head(head: nn.Module, *, keep_normalizer: bool = False) -> None:
    """``zero_initial_vf``: zero every parameter of ``head``, its normaliser's running statistics
    included (MineStudio's meaning), or, with ``keep_normalizer``, only what ``reset_parameters``
    zeroes (the output layer), so the first values are the normaliser's mean."""
    if keep_normalizer:
        head.reset_parameters()
        return
    for param in head.parameters():
        param.zero_()
