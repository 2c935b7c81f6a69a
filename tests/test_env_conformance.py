"""The env conformance suite on the built-in envs (CartPole through gymnasium, Crafter, MineStudio's
MinecraftSim on the fake engine), and each of its checks failing on an env that breaks that rule."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
from minestudio.simulator.callbacks import JudgeResetCallback
from pydantic import BaseModel, ConfigDict

from mineonline_core.builtin.envs import CrafterEnv, GymnasiumEnv, MineStudioEnv
from mineonline_core.contracts.envs import EnvFactory
from mineonline_core.testing.env_conformance import EnvConformance
from mineonline_core.testing.envs import PACED_CARTPOLE
from mineonline_core.testing.minecraft import with_fake_engine

# The env subprocess check unpickles this module's envs where the tests package may not import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TestGymnasiumCartPole(EnvConformance):
    env_cls = GymnasiumEnv
    options = {"id": "CartPole-v1", "max_episode_steps": 20}
    time_limit = 20


class TestPacedCartPole(EnvConformance):
    """The fault suite's runs step CartPole paced (``mineonline_core.testing.envs``): the same rules hold."""

    env_cls = GymnasiumEnv
    options = {"id": PACED_CARTPOLE, "max_episode_steps": 20}
    time_limit = 20


def test_paced_cartpole_is_cartpole_step_for_step_each_step_asleep_first() -> None:
    paced, plain = gym.make(PACED_CARTPOLE), gym.make("CartPole-v1")
    np.testing.assert_array_equal(paced.reset(seed=3)[0], plain.reset(seed=3)[0])
    started = time.monotonic()
    for action in (0, 1, 1, 0, 1):
        assert [np.asarray(x).tolist() for x in paced.step(action)] == [
            np.asarray(x).tolist() for x in plain.step(action)
        ]
    assert time.monotonic() - started >= 5 * 0.01  # a sleep takes at least what it was asked


class TestCrafter(EnvConformance):
    env_cls = CrafterEnv
    options = {"area": 32, "length": 20, "seed": 0}
    time_limit = 20


class TestMineStudioAdapter(EnvConformance):
    env_cls = MineStudioEnv
    options = {"obs_size": (32, 32), "num_empty_frames": 2, "callbacks": [JudgeResetCallback(6)]}
    time_limit = 6

    def make_generator(self) -> Any:
        return with_fake_engine(super().make_generator())


# ---------------------------------------------------------------------------------------------
# An env that breaks one rule on request: every check must fail on its rule's breach
# ---------------------------------------------------------------------------------------------

LIMIT = 8


class RuleBreakingEnv(gym.Env):
    """Random observations in [-1, 1]^2, episodes cut at ``LIMIT`` steps or ended at random."""

    def __init__(self, fault: str) -> None:
        self.fault, self.t = fault, 0
        box = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.observation_space = box if fault == "box_space" else gym.spaces.Dict({"obs": box})
        self.action_space = gym.spaces.Discrete(3)
        self.rng = np.random.default_rng()

    def _obs(self) -> Any:
        x = self.rng.uniform(-1.0, 1.0, 3 if self.fault == "obs_shape" else 2).astype(np.float32)
        return x if self.fault == "box_space" else {"obs": x}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        if seed is not None and self.fault != "unseeded":
            self.rng = np.random.default_rng(seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: Any) -> tuple[Any, Any, Any, Any, Any]:
        self.t += 1
        reward = float("nan") if self.fault == "nan_reward" and self.t == 3 else float(action) - 1.0
        at_limit = self.t >= LIMIT and self.fault != "never_ends"
        terminated = bool(self.rng.random() < 0.05) or (at_limit and self.fault == "limit_as_terminal")
        truncated = at_limit and self.fault != "limit_as_terminal"
        if self.fault == "int_ends":
            return self._obs(), reward, int(terminated), int(truncated), {}
        return self._obs(), reward, terminated, truncated, [] if self.fault == "info_list" else {}

    def close(self) -> None:
        if self.fault == "close_raises":
            raise RuntimeError("close failed")


class RuleBreakingFactory(EnvFactory):
    name = "rule_breaking"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        fault: str = "none"
        parent_pid: int = 0  # for "subprocess_fails": the only process where it builds

    @classmethod
    def build(cls, options: BaseModel) -> gym.Env:
        if options.fault == "subprocess_fails" and os.getpid() != options.parent_pid:
            raise RuntimeError("this env only builds in the process that configured it")
        return RuleBreakingEnv(options.fault)


class LaxConfigFactory(RuleBreakingFactory):
    name = "lax_config"

    class Config(BaseModel):  # pydantic's default extra="ignore": a typo would vanish
        fault: str = "none"


class TestRuleKeepingFixture(EnvConformance):
    """The same env without a fault passes every check: the failures below are the faults'."""

    env_cls = RuleBreakingFactory
    time_limit = LIMIT


BREACHES = [
    ("box_space", "test_build_gives_a_gymnasium_env_with_dict_observations", "not a Dict"),
    ("obs_shape", "test_steps_stay_in_the_spaces_with_finite_rewards_and_boolean_ends", r"float32\(3,\)"),
    ("nan_reward", "test_steps_stay_in_the_spaces_with_finite_rewards_and_boolean_ends", "not finite"),
    ("int_ends", "test_steps_stay_in_the_spaces_with_finite_rewards_and_boolean_ends", "not a bool"),
    ("info_list", "test_steps_stay_in_the_spaces_with_finite_rewards_and_boolean_ends", "info is a list"),
    (
        "limit_as_terminal",
        "test_an_episode_cut_by_the_time_limit_is_truncated_not_terminated",
        "without truncated=True",
    ),
    ("never_ends", "test_an_episode_cut_by_the_time_limit_is_truncated_not_terminated", "time_limit=8"),
    ("unseeded", "test_the_same_seed_and_actions_give_the_same_episode", "under the same seed"),
    ("close_raises", "test_close_works_after_use_and_on_a_fresh_env", "close failed"),
    (
        "subprocess_fails",
        "test_the_generator_builds_resets_and_steps_in_an_env_subprocess",
        "only builds in the process",
    ),
]


@pytest.mark.parametrize(("fault", "check", "message"), BREACHES, ids=[b[0] for b in BREACHES])
def test_each_check_fails_on_an_env_that_breaks_its_rule(fault: str, check: str, message: str) -> None:
    class Suite(EnvConformance):
        env_cls = RuleBreakingFactory
        options = {"fault": fault, "parent_pid": os.getpid()}
        time_limit = LIMIT

    with pytest.raises((AssertionError, RuntimeError), match=message):
        getattr(Suite(), check)()


def test_a_config_that_ignores_unknown_keys_fails_the_factory_check() -> None:
    class Suite(EnvConformance):
        env_cls = LaxConfigFactory

    with pytest.raises(AssertionError, match="extra='ignore'"):
        Suite().test_factory_declares_a_name_and_a_config_that_rejects_misspelt_keys()
