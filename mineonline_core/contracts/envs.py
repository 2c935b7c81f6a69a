"""The env contract: what an env plugin implements and what the rollout loop relies on.

An env plugin registers an ``EnvFactory`` subclass (``mineonline_register_envs``) with a ``name``
(what ``env_config.name`` selects), a pydantic ``Config`` of its options (the other keys of
``env_config``, validated before Ray starts) and a ``build(options)`` classmethod. ``build`` returns a
gymnasium env that honours, in the env's own subprocess:

* ``observation_space`` is a ``gymnasium.spaces.Dict``; every observation lies in it, with fixed
  shapes (fragments stack them). By convention ``{"image": uint8 (H, W, 3)}`` or ``{"obs": float32}``.
* ``reset(seed=None, options=None) -> (obs, info)``; with a seed, the same seed gives the same first
  observation where the env can be seeded.
* ``step(action) -> (obs, reward, terminated, truncated, info)`` for any action of
  ``action_space``: ``reward`` a finite float; ``terminated`` a true end (nothing to bootstrap);
  ``truncated`` a cut (time limit: the value of ``obs`` is bootstrapped); after either the loop
  calls ``reset``. ``info["achievements"]`` (at an episode's end) and ``info["task"]`` are optional.
* ``close()`` releases the env's resources and may be called once, after any of the above.

``adapt_env`` (here) turns old-gym envs (Crafter), MineStudio's ``MinecraftSim`` and envs with a
``Box`` observation into such an env; the rollout loop applies it to whatever an env generator returns.
``mineonline_core.testing.env_conformance`` checks a factory against this contract.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
from pydantic import BaseModel, ConfigDict

from mineonline_core.errors import ConfigError


class EnvFactory:
    """Base class of registered envs: ``build(options)`` returns a gymnasium env (see the module docs)."""

    #: The name ``env_config.name`` selects.
    name: ClassVar[str] = ""

    class Config(BaseModel):
        """The factory's options: the keys of ``env_config`` other than ``name``."""

        model_config = ConfigDict(extra="forbid")

    @classmethod
    def build(cls, options: BaseModel) -> gym.Env:
        """A new env (a ``gym.Env``) for ``options``, an instance of ``cls.Config``."""
        raise NotImplementedError


def env_generator_from_config(env_cls: type[EnvFactory], options: BaseModel) -> Callable[[], gym.Env]:
    """A picklable zero-argument env generator for a registered env and its validated options."""
    return functools.partial(env_cls.build, options)


def _is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3


class DictObservation(gym.ObservationWrapper):
    """Wrap a Box observation as ``{"image": ...}`` (uint8 HxWxC) or ``{"obs": float32}``."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        space = env.observation_space
        if _is_image(space):
            self.key = "image"
            inner = space
        else:
            self.key = "obs"
            inner = gym.spaces.Box(space.low.astype(np.float32), space.high.astype(np.float32), dtype=np.float32)
        self.observation_space = gym.spaces.Dict({self.key: inner})

    def observation(self, observation: Any) -> dict:
        dtype = np.uint8 if self.key == "image" else np.float32
        return {self.key: np.asarray(observation, dtype=dtype)}


def adapt_env(env: Any) -> gym.Env:
    """Make any supported env a gymnasium env with dict observations."""
    if not isinstance(env, gym.Env) and hasattr(env, "step") and hasattr(env, "reset"):
        env = OldGymAdapter(env)
    if type(env).__module__.startswith("minestudio.") and not isinstance(env, MinecraftAdapter):
        env = MinecraftAdapter(env)
    if not isinstance(env.observation_space, gym.spaces.Dict):
        env = DictObservation(env)
    return env


def adapted(env_generator: Callable[[], Any]) -> Callable[[], gym.Env]:
    """A picklable env function that adapts whatever ``env_generator`` returns."""
    return functools.partial(_build_adapted, env_generator)


def _build_adapted(env_generator: Callable[[], Any]) -> gym.Env:
    return adapt_env(env_generator())


class OldGymAdapter(gym.Env):
    """An env with ``reset() -> obs`` and ``step() -> (obs, reward, done, info)`` (old gym, Crafter).

    ``done`` becomes ``terminated`` when ``info["discount"] == 0`` (a true terminal such as death) and
    ``truncated`` otherwise (a time limit), so GAE bootstraps through time limits.
    """

    def __init__(self, env: Any) -> None:
        self.env = env
        self.observation_space = _to_gym_space(env.observation_space)
        self.action_space = _to_gym_space(env.action_space)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        return self.env.reset(), {}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, done, info = self.env.step(int(action) if np.ndim(action) == 0 else action)
        terminated = bool(done) and float(info.get("discount", 0.0)) == 0.0
        return obs, float(reward), terminated, bool(done) and not terminated, info

    def close(self) -> None:
        if hasattr(self.env, "close"):
            self.env.close()


def _to_gym_space(space: Any) -> gym.Space:
    if isinstance(space, gym.Space):
        return space
    if hasattr(space, "n"):
        return gym.spaces.Discrete(int(space.n))
    if hasattr(space, "shape") and hasattr(space, "low"):
        shape = tuple(int(n) for n in space.shape)
        return gym.spaces.Box(np.broadcast_to(space.low, shape), np.broadcast_to(space.high, shape), shape, space.dtype)
    raise ConfigError(f"Unsupported space {space!r}: wrap the env so it exposes gymnasium spaces.")


class MinecraftAdapter(gym.Wrapper):
    """Adapt MineStudio's ``MinecraftSim`` to the loop's contract.

    * ``reset``: ``MinecraftSim.reset(self)`` takes no argument (MineStudio 1.1.6; its world seed is
      fixed when it is built), so ``seed`` goes to the wrapped reset only when its signature takes
      one; otherwise it seeds the simulator's ``np_random``, which its callbacks draw from (where
      ``SummonMobsCallback`` places mobs).
    * Observations keep only the policy's input (``image``); the rest moves to ``info`` so that
      fragments hold fixed-shape arrays.
    * Episode ends are truncations. ``MinecraftSim`` reports the engine's ``done`` as ``terminated =
      truncated = done`` and ``JudgeResetCallback``'s time limit as ``terminated`` alone; Minecraft has
      no terminal state (dying respawns), so GAE bootstraps through every end.
    * At an episode's end ``info["achievements"]`` holds what MineRL's statistics (``kill_entity``,
      ``mine_block``, ``craft_item``, ``pickup``) counted during the episode, e.g. ``kill_entity/cow``;
      they reach the metrics as ``achievement/success/...``.
    """

    STATISTICS: ClassVar[tuple[str, ...]] = ("kill_entity", "mine_block", "craft_item", "pickup")

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        space = getattr(env, "observation_space", None)
        image_space = space["image"] if isinstance(space, gym.spaces.Dict) and "image" in space.spaces else None
        self.observation_space = gym.spaces.Dict(
            {"image": image_space or gym.spaces.Box(0, 255, (128, 128, 3), np.uint8)}
        )
        self._reset_takes_seed = _takes_keyword(env.reset, "seed")
        self._counts_at_reset: dict[str, float] = {}

    def _split(self, obs: dict, info: dict) -> tuple[dict, dict]:
        extra = {k: v for k, v in obs.items() if k != "image"}
        return {"image": np.asarray(obs["image"], dtype=np.uint8)}, {**info, **({"obs_extra": extra} if extra else {})}

    def _counts(self, info: dict) -> dict[str, float]:
        counts = {}
        for stat in self.STATISTICS:
            for name, value in (info.get(stat) or {}).items():
                counts[f"{stat}/{name}"] = float(np.asarray(value).sum())
        return counts

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if self._reset_takes_seed:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            if seed is not None:
                self.env.unwrapped.np_random = np.random.default_rng(seed)
            obs, info = self.env.reset()
        self._counts_at_reset = self._counts(info)
        return self._split(obs, info)

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        obs, info = self._split(obs, info)
        ended = bool(terminated) or bool(truncated)
        if ended:
            before = self._counts_at_reset
            counts = {k: v - before.get(k, 0.0) for k, v in self._counts(info).items()}
            info["achievements"] = {k: int(v) for k, v in counts.items() if v > 0}
        return obs, float(reward), False, ended, info


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def clip_action(action: Any, space: Any) -> Any:
    """The action the env is sent for what the policy sampled: a float array into a ``Box`` space's bounds, in
    the space's dtype (a Gaussian head samples without bounds); any other action as it is.

    Every path from a policy to an env goes through here: rollout (``rollout/envproc.py``'s
    ``apply_command``), evaluation and ``load_policy(...).predict`` (``services/episodes.py``). The fragment
    keeps the sampled action, whose log-prob the behaviour policy recorded (as CleanRL and Stable-Baselines3 do)."""
    if isinstance(space, gym.spaces.Box) and isinstance(action, np.ndarray) and action.dtype.kind == "f":
        return np.clip(action, space.low, space.high).astype(space.dtype, copy=False)
    return action
