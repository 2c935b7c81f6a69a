"""The env conformance suite: what the rollout loop relies on from an env factory.

An env plugin tests its factory with a short subclass::

    class TestMyEnv(EnvConformance):
        env_cls = MyEnvFactory
        options = {"level": 1, "max_steps": 30}   # env_config's keys other than name
        time_limit = 30                             # the episode length those options cap, or None

The contract (``mineonline_core.contracts.envs``): the factory declares a ``name`` and a ``Config``
that rejects misspelt keys; ``build`` returns a gymnasium env with a ``Dict`` observation space;
``reset`` and ``step`` answer observations inside that space (fixed shapes: fragments stack them),
finite float rewards, boolean ``terminated``/``truncated`` and dict infos; an episode cut by the time
limit is ``truncated``, never ``terminated`` (its value is bootstrapped); the same seed and actions give
the same episode (``seeded = False`` for an env that cannot be seeded); ``close`` works; and the
generator survives pickling into an env subprocess, where it builds, resets and steps.

Envs are built as the runtime builds them: each from its own unpickled copy of the generator, so
envs never share mutable options (MineStudio's callbacks keep per-episode counters).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, ClassVar

import cloudpickle
import gymnasium as gym
import numpy as np
from pydantic import BaseModel

from mineonline_core.contracts.envs import EnvFactory, env_generator_from_config


class EnvConformance:
    """Tests inherited by ``TestXxx`` subclasses; set ``env_cls`` and ``options``."""

    env_cls: ClassVar[type[EnvFactory]]
    options: ClassVar[dict[str, Any]] = {}
    time_limit: ClassVar[int | None] = None  # episodes of this many steps must end truncated
    seeded: ClassVar[bool] = True  # reset(seed=s) and the same actions reproduce an episode
    steps: ClassVar[int] = 64  # steps each stepping check drives

    def make_generator(self) -> Callable[[], gym.Env]:
        """The zero-argument env generator the runtime would ship to each env process."""
        return env_generator_from_config(self.env_cls, self.env_cls.Config(**self.options))

    # -- helpers ----------------------------------------------------------------------------------

    def make_env(self) -> gym.Env:
        return cloudpickle.loads(cloudpickle.dumps(self.make_generator()))()

    @staticmethod
    def check_observation(env: gym.Env, obs: Any, where: str) -> None:
        space = env.observation_space
        assert isinstance(obs, dict), f"{where}: the observation is a {type(obs).__name__}, not a dict"
        assert set(obs) == set(space.spaces), (
            f"{where}: observation keys {sorted(obs)} != space keys {sorted(space.spaces)}"
        )
        for key, sub in space.spaces.items():
            value = np.asarray(obs[key])
            assert value.shape == sub.shape and value.dtype == sub.dtype, (
                f"{where}: obs[{key!r}] is {value.dtype}{value.shape}, the space says {sub.dtype}{sub.shape}"
            )
        assert space.contains(obs), f"{where}: the observation lies outside observation_space {space}"

    @staticmethod
    def check_step(answer: Any, where: str) -> tuple[float, bool, bool, dict]:
        assert isinstance(answer, tuple) and len(answer) == 5, (
            f"{where}: step must return (obs, reward, terminated, truncated, info)"
        )
        _, reward, terminated, truncated, info = answer
        assert isinstance(reward, (int, float, np.integer, np.floating)) and not isinstance(reward, (bool, np.bool_)), (
            f"{where}: reward {reward!r} is a {type(reward).__name__}, not a number"
        )
        assert math.isfinite(float(reward)), f"{where}: reward {reward!r} is not finite"
        for flag, value in (("terminated", terminated), ("truncated", truncated)):
            assert isinstance(value, (bool, np.bool_)), (
                f"{where}: {flag} {value!r} is a {type(value).__name__}, not a bool"
            )
        assert isinstance(info, dict), f"{where}: info is a {type(info).__name__}, not a dict"
        achievements = info.get("achievements", {})
        assert isinstance(achievements, dict) and all(
            isinstance(v, (int, float, np.number)) for v in achievements.values()
        ), f"{where}: info['achievements'] must map names to counts, got {achievements!r}"
        return float(reward), bool(terminated), bool(truncated), info

    def drive(self, env: gym.Env, steps: int, *, seed: int | None = 0) -> list[tuple[Any, float, bool, bool]]:
        """``steps`` steps with actions sampled from a seeded action space, resetting after each end;
        every answer checked. Returns (observation, reward, terminated, truncated) per step."""
        actions = env.action_space  # once: MinecraftSim builds a new space at every access
        actions.seed(0)
        obs, info = env.reset(seed=seed)
        self.check_observation(env, obs, "reset()")
        assert isinstance(info, dict), f"reset(): info is a {type(info).__name__}, not a dict"
        out = []
        for t in range(steps):
            action = actions.sample()
            answer = env.step(copy.deepcopy(action))  # some envs consume the action they are given
            reward, terminated, truncated, _ = self.check_step(answer, f"step {t}")
            self.check_observation(env, answer[0], f"step {t}")
            out.append((answer[0], reward, terminated, truncated))
            if terminated or truncated:
                obs, _ = env.reset()
                self.check_observation(env, obs, f"reset() after the episode end at step {t}")
        return out

    # -- the contract -------------------------------------------------------------------------------

    def test_factory_declares_a_name_and_a_config_that_rejects_misspelt_keys(self) -> None:
        assert isinstance(self.env_cls, type) and issubclass(self.env_cls, EnvFactory), (
            f"{self.env_cls!r} is not an EnvFactory"
        )
        assert isinstance(self.env_cls.name, str) and self.env_cls.name, f"{self.env_cls.__name__}.name is empty"
        assert issubclass(self.env_cls.Config, BaseModel), f"{self.env_cls.__name__}.Config is not a pydantic model"
        self.env_cls.Config(**self.options)
        extra = self.env_cls.Config.model_config.get("extra", "ignore")
        assert extra in ("forbid", "allow"), (
            f"{self.env_cls.__name__}.Config has extra={extra!r}: a misspelt env_config key would be dropped "
            "silently. Use extra='forbid' (or 'allow' when the keys are passed on to the env)."
        )

    def test_build_gives_a_gymnasium_env_with_dict_observations(self) -> None:
        env = self.make_env()
        try:
            assert isinstance(env, gym.Env), f"build returned a {type(env).__name__}, not a gymnasium.Env"
            assert isinstance(env.observation_space, gym.spaces.Dict), (
                f"observation_space is {env.observation_space}, not a Dict (wrap the env with adapt_env)"
            )
            assert isinstance(env.action_space, gym.Space), f"action_space is {env.action_space!r}"
        finally:
            env.close()

    def test_steps_stay_in_the_spaces_with_finite_rewards_and_boolean_ends(self) -> None:
        env = self.make_env()
        try:
            self.drive(env, self.steps)
        finally:
            env.close()

    def test_an_episode_cut_by_the_time_limit_is_truncated_not_terminated(self) -> None:
        if self.time_limit is None:
            return  # no time limit to check
        env = self.make_env()
        try:
            answers = self.drive(env, 3 * self.time_limit)
        finally:
            env.close()
        length, ended = 0, 0
        for t, (_, _, terminated, truncated) in enumerate(answers):
            length += 1
            assert length <= self.time_limit, f"step {t}: the episode ran past time_limit={self.time_limit}"
            if length == self.time_limit:
                assert truncated, f"step {t}: the episode reached time_limit={self.time_limit} without truncated=True"
            if terminated or truncated:
                length, ended = 0, ended + 1
        assert ended >= 2, f"{3 * self.time_limit} steps ended {ended} episodes with time_limit={self.time_limit}"

    def test_the_same_seed_and_actions_give_the_same_episode(self) -> None:
        if not self.seeded:
            return  # the subclass declares the env unseedable
        first, second = self.make_env(), self.make_env()
        try:
            a, b = self.drive(first, self.steps, seed=7), self.drive(second, self.steps, seed=7)
        finally:
            first.close()
            second.close()
        for t, (x, y) in enumerate(zip(a, b)):
            assert x[1:] == y[1:], f"step {t}: (reward, terminated, truncated) {x[1:]} vs {y[1:]} under the same seed"
            for key in x[0]:
                assert np.array_equal(x[0][key], y[0][key]), f"step {t}: obs[{key!r}] differs under the same seed"

    def test_close_works_after_use_and_on_a_fresh_env(self) -> None:
        used = self.make_env()
        self.drive(used, 4)
        used.close()
        self.make_env().close()

    def test_the_generator_builds_resets_and_steps_in_an_env_subprocess(self) -> None:
        from mineonline_core.errors import ConfigError
        from mineonline_core.driver.envcheck import probe_env

        try:
            observation_space, action_space = probe_env(self.make_generator(), startup_timeout=120.0, step_timeout=60.0)
        except ConfigError as exc:
            raise AssertionError(f"in an env subprocess: {exc}") from exc
        env = self.make_env()
        try:
            assert observation_space == env.observation_space, (
                f"{observation_space} there, {env.observation_space} here"
            )
            assert action_space == env.action_space, f"{action_space} there, {env.action_space} here"
        finally:
            env.close()
