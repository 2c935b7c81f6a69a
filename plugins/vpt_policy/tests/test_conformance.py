"""The VPT policy (a small model of the same architecture) passes the core's policy conformance suite."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from mineonline_core.testing.policy_conformance import PolicyConformance
from mineonline_vpt import VPTPolicy

# maxlen 6 < steps: the attention band clips inside one call, the case most likely to differ stepwise.
SMALL = {
    "hidsize": 32,
    "impala_chans": [8, 16, 16],
    "n_recurrence_layers": 2,
    "attention_heads": 4,
    "attention_memory_size": 10,
    "timesteps": 4,
}


class TestVPTPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)})
    action_space = gym.spaces.Discrete(17)
    steps = 9

    def make_policy(self) -> VPTPolicy:
        return VPTPolicy.build(SMALL, observation_space=self.observation_space, action_space=self.action_space)
