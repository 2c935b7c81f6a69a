"""The core's policies pass the policy conformance suite that policy plugins reuse."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from mineonline_core.builtin.models import MLPPolicy, RecurrentCNNPolicy, RecurrentMLPPolicy
from mineonline_core.testing.policy_conformance import PolicyConformance


class TestMLPPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-2.0, 2.0, (4,), np.float32)})
    action_space = gym.spaces.Discrete(2)

    def make_policy(self) -> MLPPolicy:
        return MLPPolicy.build(
            MLPPolicy.Config(hidden_sizes=[16, 16]),
            observation_space=self.observation_space,
            action_space=self.action_space,
        )


class TestRecurrentMLPPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-2.0, 2.0, (5,), np.float32)})
    action_space = gym.spaces.Discrete(3)

    def make_policy(self) -> RecurrentMLPPolicy:
        config = RecurrentMLPPolicy.Config(hidden_sizes=[16], hidden_size=12)
        return RecurrentMLPPolicy.build(
            config, observation_space=self.observation_space, action_space=self.action_space
        )


class TestRecurrentCNNPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)})
    action_space = gym.spaces.Discrete(5)

    def make_policy(self) -> RecurrentCNNPolicy:
        config = RecurrentCNNPolicy.Config(channels=[4, 8, 8], hidden_size=16)
        return RecurrentCNNPolicy.build(
            config, observation_space=self.observation_space, action_space=self.action_space
        )
