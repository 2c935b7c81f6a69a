"""Observation and reward normalisation (``train_config.normalize_observations`` / ``normalize_rewards``).

Both keep running statistics as buffers of small modules the policy owns (``policy.obs_normalizer``,
``policy.reward_normalizer``), so the statistics travel with the weights: in every checkpoint, restored
by a resume, in each weight broadcast to the rollout workers, the inference server and the evaluator,
and in ``load_policy``. The policy generator attaches them (``Normalization.attach``), so every process
that builds the policy agrees on its state-dict keys.

Only the trainer moves the statistics, from its training batches, once per sample: a chunk counts the
first time the replay buffer serves it (``FIRST_SERVING``; ``max_reuse`` serves it again), and the ranks
merge their batches' moments in rank order (``gather``), so every rank holds the same statistics
without a broadcast and each step counts once in the whole world. Rollout and evaluation only apply them.

* Observations (SB3's ``VecNormalize``): ``(obs - mean) / sqrt(var + 1e-8)`` per feature of
  ``input["obs"]``, clipped to +-10, applied by a forward pre-hook, so the replay store keeps raw
  observations and each forward normalises with the statistics of the weights it runs. They move after
  an iteration's update, before its weights are broadcast: the estimate pass and the update see the
  statistics the behaviour policy of fresh data used, so on-policy data keeps a ratio of exactly 1.
* Rewards (``VecNormalize``, CleanRL's ``NormalizeReward``): each reward divided by the running standard
  deviation of the discounted return ``ret_t = gamma * ret_{t-1} + r_t`` (0 before an episode's first
  step), clipped to +-10, before the advantages are estimated; ``reward_raw`` keeps the raw rewards.
  The return is accumulated along each chunk from 0 at the chunk's first step: chunks reach the
  trainer out of order and on several ranks, so the sum before a chunk is not known there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from mineonline_core.contracts import fragment as F
from mineonline_core.errors import ConfigError

OBS_KEY = "obs"
CLIP = 10.0
EPSILON = 1e-8
# (N,) bool batch column: the chunk is served for the first time (its steps move the statistics).
FIRST_SERVING = "first_serving"
RAW_REWARD = "reward_raw"  # the batch's rewards before scaling


class RunningMeanStd(nn.Module):
    """Running mean and population variance per feature, merged batch by batch with Chan et al.'s
    parallel rule (exact for any split of the samples). Float64 buffers: counts pass 2**24 samples."""

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def moments(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., *shape)'s count, mean and variance packed in one float64 row (1, 1 + 2 * size)."""
        x = x.detach().to(torch.float64).reshape(-1, *self.mean.shape)
        n = x.shape[0]
        mean = x.mean(0) if n else torch.zeros_like(self.mean)
        var = x.var(0, unbiased=False) if n else torch.zeros_like(self.var)
        count = torch.full((1,), float(n), dtype=torch.float64, device=x.device)
        return torch.cat([count, mean.reshape(-1), var.reshape(-1)])[None]

    @torch.no_grad()
    def merge(self, rows: torch.Tensor) -> None:
        """Fold in packed ``moments`` rows (one per rank), in order."""
        size = self.mean.numel()
        for row in rows.to(self.mean.device, torch.float64):
            n, mean, var = row[0], row[1 : 1 + size].view_as(self.mean), row[1 + size :].view_as(self.var)
            if n <= 0:
                continue
            total = self.count + n
            delta = mean - self.mean
            m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
            self.mean.add_(delta * n / total)
            self.var.copy_(m2 / total)
            self.count.copy_(total)

    def update(self, x: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Move the statistics by the samples ``x`` (..., *shape); ``gather`` concatenates every rank's rows."""
        rows = self.moments(x)
        self.merge(gather(rows) if gather is not None else rows)

    def scale(self) -> torch.Tensor:
        return (self.var + EPSILON).sqrt()

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype if x.is_floating_point() else torch.float32
        return ((x.to(torch.float64) - self.mean) / self.scale()).clamp(-CLIP, CLIP).to(dtype)


def _normalize_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook: the policy's ``input["obs"]`` normalised by ``module.obs_normalizer``."""
    positional = bool(args)
    input = args[0] if positional else kwargs.get("input")  # noqa: A001 - the contract's argument name
    if not isinstance(input, Mapping) or OBS_KEY not in input:
        return None
    input = {**input, OBS_KEY: module.obs_normalizer.normalize(input[OBS_KEY])}
    if positional:
        return (input, *args[1:]), kwargs
    return args, {**kwargs, "input": input}


@dataclasses.dataclass(frozen=True)
class Normalization:
    """What the policy generator attaches: an observation normaliser of ``obs_shape`` (None: none) and
    a reward normaliser. Picklable: it travels inside the generator to every process."""

    obs_shape: tuple[int, ...] | None = None
    rewards: bool = False

    def attach(self, policy: nn.Module) -> nn.Module:
        if self.obs_shape is not None:
            policy.obs_normalizer = RunningMeanStd(self.obs_shape)
            policy.register_forward_pre_hook(_normalize_input, with_kwargs=True)
        if self.rewards:
            policy.reward_normalizer = RunningMeanStd(())
        return policy


def normalization_for(
    *, normalize_observations: bool, normalize_rewards: bool, observation_space: Any
) -> Normalization | None:
    """The ``Normalization`` of these keys for an env observing ``observation_space`` (None: both off).
    A key that cannot apply raises ``ConfigError`` (before Ray starts)."""
    if not normalize_observations and not normalize_rewards:
        return None
    shape = None
    if normalize_observations:
        spaces = getattr(observation_space, "spaces", None)
        space = spaces.get(OBS_KEY) if isinstance(spaces, Mapping) else None
        if space is None or getattr(space, "shape", None) is None or not space.shape:
            raise ConfigError(
                f"train_config.normalize_observations: true normalises the vector observation "
                f"{{'{OBS_KEY}': float array}}, but the env observes {observation_space}, which has no "
                f"'{OBS_KEY}' array to normalise (images and other keys are never normalised). Fix: set "
                f"train_config.normalize_observations: false, or have the env return its features as "
                f"{{'{OBS_KEY}': ...}} (a gymnasium Box observation is wrapped that way)."
            )
        shape = tuple(int(d) for d in space.shape)
    return Normalization(obs_shape=shape, rewards=normalize_rewards)


def _first_serving(batch: Mapping[str, Any], n: int, device: torch.device) -> torch.Tensor:
    fresh = batch.get(FIRST_SERVING)
    return torch.ones(n, dtype=torch.bool, device=device) if fresh is None else fresh.to(device).bool()


def update_observation_statistics(
    policy: nn.Module, batch: dict[str, Any], *, gather: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> dict[str, float]:
    """After an iteration's update: move ``policy.obs_normalizer`` by the observations of the batch's
    chunks served for the first time. Returns metrics (none without an observation normaliser)."""
    norm = getattr(policy, "obs_normalizer", None)
    if norm is None:
        return {}
    obs = batch[F.OBS][OBS_KEY]
    norm.update(obs[_first_serving(batch, obs.shape[0], obs.device)], gather)
    return {"normalize/obs_count": float(norm.count)}


def discounted_returns(reward: torch.Tensor, first: torch.Tensor, discount: float) -> torch.Tensor:
    """``ret_t = discount * ret_{t-1} + r_t`` along each row of (N, L), restarting at ``first`` and at t = 0."""
    reward = reward.to(torch.float64)
    out = torch.empty_like(reward)
    running = torch.zeros(reward.shape[0], dtype=torch.float64, device=reward.device)
    keep = (~first.bool()).to(torch.float64)
    for t in range(reward.shape[1]):
        running = discount * running * keep[:, t] + reward[:, t]
        out[:, t] = running
    return out


def scale_rewards(
    policy: nn.Module,
    batch: dict[str, Any],
    *,
    discount: float,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Before the estimate: move ``policy.reward_normalizer`` by the discounted returns of the chunks
    served for the first time, then divide every reward by the returns' standard deviation (clipped to
    +-10); the raw rewards stay in ``reward_raw``. A policy without a reward normaliser: unchanged."""
    norm = getattr(policy, "reward_normalizer", None)
    if norm is None:
        return batch
    reward = batch[F.REWARD]
    returns = discounted_returns(reward, batch[F.FIRST], discount)
    norm.update(returns[_first_serving(batch, reward.shape[0], reward.device)], gather)
    batch[RAW_REWARD] = reward
    batch[F.REWARD] = (reward.to(torch.float64) / norm.scale()).clamp(-CLIP, CLIP).to(reward.dtype)
    return batch
