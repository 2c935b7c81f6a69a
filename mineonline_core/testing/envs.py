"""Small envs for tests and benchmarks, without torch: env subprocesses unpickle these factories by
reference, so importing this module is all an env process pays (``mineonline_core.testing.kit``, which
imports torch for its policies, re-exports them).

``CountingEnv`` (observations that let a test check step continuity), ``TinyImageEnv`` (random frames,
episodes ending by termination and by time limit), ``cartpole`` and the module-level factories
``counting``, ``time_limited_counting``, ``counting_failing_reset`` and ``faulty_counting``.

``PACED_CARTPOLE`` names, for a run's ``env_config.id``, CartPole whose every step takes 10 ms asleep;
``paced_counting`` is ``CountingEnv`` paced alike.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np

from mineonline_core.contracts.envs import DictObservation


class CountingEnv(gym.Env):
    """Observation ``{"obs": [tag, t, episode]}`` (float32): lets tests check step continuity.

    Reward is 1 per step; the episode terminates after ``episode_len`` steps (``terminate=True``)
    or runs on until a ``TimeLimit`` wrapper truncates it. ``image=True`` adds a small RGB frame.
    """

    def __init__(
        self,
        *,
        tag: float = 0.0,
        episode_len: int = 10,
        terminate: bool = True,
        image: bool = False,
        final_reward: float = 1.0,
    ) -> None:
        self.tag, self.episode_len, self.terminate, self.image = tag, episode_len, terminate, image
        self.final_reward = final_reward  # the reward of an episode's terminal step
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
        return self._obs(), self.final_reward if done else 1.0, done, False, info


def cartpole(max_steps: int = 500) -> gym.Env:
    """CartPole-v1 with ``{"obs": float32}`` observations; a short ``max_steps`` makes fragments hold
    both terminations and truncations."""
    return DictObservation(gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, max_episode_steps=max_steps))


class Paced(gym.Wrapper):
    """Each step sleeps ``step_s`` first. A run a test only waits on, for a kill, a restart or a stop, then makes
    its iterations at an env's pace instead of as fast as two cores allow: CartPole's runs went through 15
    iterations a second, a checkpoint each, and took the CPU the rest of the suite waited for."""

    def __init__(self, env: gym.Env, step_s: float) -> None:
        super().__init__(env)
        self.step_s = step_s

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        time.sleep(self.step_s)
        return self.env.step(action)


def paced_cartpole(step_s: float = 0.01) -> gym.Env:
    return Paced(gym.make("CartPole-v1"), step_s)


def paced_counting(step_s: float = 0.01, **counting: Any) -> gym.Env:
    return Paced(CountingEnv(**counting), step_s)


# gym.make("module:Id") imports the module first: env processes and the driver's probe find it by name alone.
gym.register("PacedCartPole-v1", entry_point=paced_cartpole)
PACED_CARTPOLE = f"{__name__}:PacedCartPole-v1"


# Env factories (module-level, so that env subprocesses can import them by reference).


def counting(tag: int, episode_len: int = 6, image: bool = False) -> gym.Env:
    return CountingEnv(tag=tag, episode_len=episode_len, image=image)


def time_limited_counting(tag: int, limit: int = 5) -> gym.Env:
    return gym.wrappers.TimeLimit(CountingEnv(tag=tag, terminate=False), max_episode_steps=limit)


def counting_failing_reset(tag: int, episode_len: int = 3, final_reward: float = 10.0) -> gym.Env:
    """Episodes of ``episode_len`` steps ending in a terminal step worth ``final_reward``; every reset
    after an episode end raises (the env's first reset works, so a rebuilt env starts)."""
    from mineonline_core.testing.faults import FaultyEnv

    return FaultyEnv(
        CountingEnv(tag=tag, episode_len=episode_len, final_reward=final_reward), reset_error_after_end=True
    )


def faulty_counting(
    tag: int,
    episode_len: int = 50,
    *,
    at_steps: tuple[int, ...] = (),
    mode: str = "raise",
    raise_rate: float = 0.0,
    hang_s: float = 3600.0,
) -> gym.Env:
    """A counting env with the public ``FaultyEnv``: fault ``mode`` at each step of ``at_steps`` in every
    life, or a step error with probability ``raise_rate``."""
    from mineonline_core.testing.faults import FaultyEnv

    scheduled = {f"{mode}_at_step": step for step in at_steps}
    assert len(scheduled) == len(at_steps), "one scheduled step per fault kind"
    return FaultyEnv(
        CountingEnv(tag=tag, episode_len=episode_len), step_error_rate=raise_rate, hang_s=hang_s, **scheduled
    )


class TinyImageEnv(gym.Env):
    """64x64 RGB noise; episodes end at random, half by termination, half by a time limit."""

    def __init__(self, seed: int = 0, mean_length: int = 6) -> None:
        self.observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
        self.action_space = gym.spaces.Discrete(3)
        self.rng = np.random.default_rng(seed)
        self.p_end = 1.0 / mean_length

    def _obs(self) -> dict:
        return {"image": self.rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        end = self.rng.random() < self.p_end
        term = end and self.rng.random() < 0.5
        return self._obs(), float(action) - 1.0, term, end and not term, {}
