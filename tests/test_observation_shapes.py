"""A wrong observation shape is reported naming the env and the key: before Ray starts when the env's
observations disagree with its own observation_space (``envcheck``), and by the rollout worker when the
policy cannot take them, instead of a bare matmul error from inside the policy."""

from __future__ import annotations

import functools
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest

from mineonline_core.driver.envcheck import probe_env
from mineonline_core.errors import ConfigError, RunFailedError
from mineonline_core.testing import kit as tk

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its env travels to the probe's process


class WrongSpace(gym.ObservationWrapper):
    """CartPole that declares five values per observation and returns four."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (5,), np.float32)})

    def observation(self, observation):
        return observation


def wrong_space() -> gym.Env:
    return WrongSpace(tk.cartpole())


def test_an_env_whose_observations_disagree_with_its_space_is_refused_before_ray() -> None:
    with pytest.raises(ConfigError, match=r"after reset .*obs has shape \(4,\), the space says \(5,\)"):
        probe_env(wrong_space, startup_timeout=60, step_timeout=30)


def test_the_probe_passes_an_env_whose_observations_match_its_space() -> None:
    observation_space, _ = probe_env(tk.cartpole, startup_timeout=60, step_timeout=30)
    assert observation_space["obs"].shape == (4,)


@pytest.mark.parametrize("env_processes", [True, False], ids=["processes", "inline"])
def test_a_policy_that_cannot_take_the_observations_names_the_envs_and_shapes(env_processes: bool) -> None:
    envs = [functools.partial(tk.counting, i) for i in range(2)]
    collector = tk.collector(
        policy=tk.TinyGRUPolicy(obs_dim=5), env_fns=envs, fragment_length=4, batch_size=2, env_processes=env_processes
    )
    try:
        collector.warmup(timeout=120)
        with pytest.raises(RunFailedError) as info:
            collector.collect(2)
    finally:
        collector.close()
    message = str(info.value)
    assert "the policy's forward failed on the observations of envs [0, 1]" in message, message
    assert "env 0: {'obs': (3,)}" in message and "RuntimeError" in message
