"""Small envs, a fault injector and tiny policies for the rollout tests and benchmarks.

They live in the package (not under ``tests/``) because env factories are unpickled in env
subprocesses and policies in Ray workers, which must be able to import them.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mineonline_core.policy import CategoricalHead, Policy, ValueHead


class CountingEnv(gym.Env):
    """Observation ``{"obs": [tag, t, episode]}`` (float32): lets tests check step continuity.

    Reward is 1 per step; the episode terminates after ``episode_len`` steps (``terminate=True``)
    or runs on until a ``TimeLimit`` wrapper truncates it. ``image=True`` adds a small RGB frame.
    """

    def __init__(self, *, tag: float = 0.0, episode_len: int = 10, terminate: bool = True, image: bool = False) -> None:
        self.tag, self.episode_len, self.terminate, self.image = tag, episode_len, terminate, image
        spaces = {"obs": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)}
        if image:
            spaces["image"] = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = gym.spaces.Discrete(2)
        self.t, self.episode = 0, -1

    def _obs(self) -> dict:
        obs = {"obs": np.array([self.tag, self.t, self.episode], np.float32)}
        if self.image:
            obs["image"] = np.full((8, 8, 3), self.t % 256, np.uint8)
        return obs

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return self._obs(), {"task": "count"}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        self.t += 1
        done = self.terminate and self.t >= self.episode_len
        info = {"achievements": {"counted": 1}} if done else {}
        return self._obs(), 1.0, done, False, info


class DictObs(gym.ObservationWrapper):
    """A vector-observation env as ``{"obs": float32}``, the shape every mineonline env yields."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"obs": env.observation_space})

    def observation(self, observation: Any) -> dict:
        return {"obs": np.asarray(observation, np.float32)}


def cartpole(max_episode_steps: int = 500) -> gym.Env:
    return DictObs(gym.make("CartPole-v1", max_episode_steps=max_episode_steps))


# ---------------------------------------------------------------------------------------------
# Tiny policies honouring the policy contract
# ---------------------------------------------------------------------------------------------


class TinyMLPPolicy(Policy):
    """Feed-forward: ``{"obs": (B,T,D)}`` → categorical logits and a value."""

    name = "tiny_mlp"

    def __init__(self, obs_dim: int = 3, n_actions: int = 2, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh())
        self.pi_head = CategoricalHead(hidden, n_actions)
        self.value_head = ValueHead(hidden, normalize=False)

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = self.body(input["obs"].float())
        return {"pi_logits": self.pi_head(x), "vpred": self.value_head(x)}, None


class TinyGRUPolicy(Policy):
    """Recurrent: a GRU cell with state (B, H), reset to zeros wherever ``first`` is set."""

    name = "tiny_gru"

    def __init__(self, obs_dim: int = 3, n_actions: int = 2, hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.inp = nn.Linear(obs_dim, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.pi_head = CategoricalHead(hidden, n_actions)
        self.value_head = ValueHead(hidden, normalize=False)

    def initial_state(self, batch_size: int) -> list[torch.Tensor]:
        return [torch.zeros(batch_size, self.hidden)]

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = torch.tanh(self.inp(input["obs"].float()))
        h, first = state_in[0], context["first"]
        outs = []
        for t in range(x.shape[1]):
            h = torch.where(first[:, t, None], torch.zeros_like(h), h)
            h = self.cell(x[:, t], h)
            outs.append(h)
        y = torch.stack(outs, 1)
        return {"pi_logits": self.pi_head(y), "vpred": self.value_head(y)}, [h]


# Env factories (module-level, so that env subprocesses can import them by reference).


def counting(tag: int, episode_len: int = 6, image: bool = False) -> gym.Env:
    return CountingEnv(tag=tag, episode_len=episode_len, image=image)


def time_limited_counting(tag: int, limit: int = 5) -> gym.Env:
    return gym.wrappers.TimeLimit(CountingEnv(tag=tag, terminate=False), max_episode_steps=limit)


def faulty_counting(tag: int, episode_len: int = 50, *, at_steps: tuple[int, ...] = (), mode: str = "raise",
                    raise_rate: float = 0.0, hang_s: float = 3600.0) -> gym.Env:
    """A counting env with the public ``FaultyEnv``: fault ``mode`` at each step of ``at_steps`` in every
    life, or a step error with probability ``raise_rate``."""
    from mineonline_core.testing.faults import FaultyEnv

    scheduled = {f"{mode}_at_step": step for step in at_steps}
    assert len(scheduled) == len(at_steps), "one scheduled step per fault kind"
    return FaultyEnv(CountingEnv(tag=tag, episode_len=episode_len), step_error_rate=raise_rate, hang_s=hang_s, **scheduled)
