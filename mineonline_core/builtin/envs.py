"""The core's env factories and the adapters that make any env meet the env contract
(``mineonline_core.contracts.envs``): a gymnasium env with dict observations.

Policies receive ``{"image": uint8 (H, W, 3)}`` for image envs and ``{"obs": float32 (...)}`` for
vector envs, so one policy contract covers CartPole, Crafter and Minecraft. ``adapt_env`` converts
old-gym 4-tuple envs (Crafter) and MineStudio's ``MinecraftSim`` (imported only when used); the
registered factories ``gymnasium``, ``crafter`` and ``minestudio`` build on it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mineonline_core.contracts.envs import EnvFactory
from mineonline_core.errors import ConfigError

CRAFTER_ACHIEVEMENTS = (
    "collect_coal", "collect_diamond", "collect_drink", "collect_iron", "collect_sapling",
    "collect_stone", "collect_wood", "defeat_skeleton", "defeat_zombie", "eat_cow", "eat_plant",
    "make_iron_pickaxe", "make_iron_sword", "make_stone_pickaxe", "make_stone_sword",
    "make_wood_pickaxe", "make_wood_sword", "place_furnace", "place_plant", "place_stone",
    "place_table", "wake_up",
)  # fmt: skip


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


class CrafterAchievements(gym.Wrapper):
    """Report Crafter's achievement counts in ``info["achievements"]`` only when an episode ends."""

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        achievements = info.get("achievements")
        info = {"task": "crafter"}
        if terminated or truncated:
            info["achievements"] = dict(achievements or {})
        return obs, reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------
# Registered env factories
# ---------------------------------------------------------------------------------------------


class GymnasiumEnv(EnvFactory):
    """Any registered gymnasium id, e.g. ``env_config: {name: gymnasium, id: CartPole-v1}``."""

    name = "gymnasium"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        id: str = Field(description="The gymnasium env id, e.g. CartPole-v1.")
        max_episode_steps: int | None = Field(None, ge=1, description="Override the env's time limit.")
        kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to gymnasium.make.")

    @classmethod
    def build(cls, options: BaseModel) -> gym.Env:
        try:
            env = gym.make(options.id, max_episode_steps=options.max_episode_steps, **options.kwargs)
        except gym.error.Error as exc:
            raise ConfigError(
                f"env_config.id: gymnasium cannot make {options.id!r} ({exc}). Use a registered id such as "
                f"'CartPole-v1', or install the package that registers it."
            ) from exc
        return adapt_env(env)


class CrafterEnv(EnvFactory):
    """Crafter (Hafner 2021) through the gymnasium adapter: 64x64 RGB, 17 actions, 22 achievements."""

    name = "crafter"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        size: int = Field(64, ge=8, description="Rendered image side in pixels.")
        area: int = Field(64, ge=16, description="World side in cells.")
        length: int = Field(10000, ge=1, description="Time limit in steps (an episode is then truncated).")
        reward: bool = Field(True, description="Use Crafter's achievement reward.")
        seed: int | None = Field(None, description="World seed; None draws a new world per env.")

    @classmethod
    def build(cls, options: BaseModel) -> gym.Env:
        try:
            import crafter
        except ImportError as exc:
            raise ConfigError(
                "env_config.name: 'crafter' needs the crafter package. Fix: pip install 'mineonline-core[crafter]'."
            ) from exc
        env = crafter.Env(
            area=(options.area, options.area), size=(options.size, options.size),
            reward=options.reward, length=options.length, seed=options.seed,
        )  # fmt: skip
        return CrafterAchievements(adapt_env(env))


def require_minestudio() -> Any:
    """Import MineStudio's simulator package, or explain exactly what is missing and how to get it."""
    try:
        import minestudio.simulator as simulator
    except ImportError as exc:
        raise ConfigError(
            f"MineStudio's simulator is not installed ({exc}), and this config runs Minecraft through "
            "minestudio.simulator.MinecraftSim. Fix: pip install minestudio (it also needs a Java 8 runtime and "
            "its simulator engine), or run a config with another env (examples/crafter.py)."
        ) from exc
    return simulator


class MineStudioEnv(EnvFactory):
    """MineStudio's ``MinecraftSim``; every key of ``env_config`` but ``name`` goes to its constructor."""

    name = "minestudio"

    class Config(BaseModel):
        model_config = ConfigDict(extra="allow")

    @classmethod
    def build(cls, options: BaseModel) -> gym.Env:
        return MinecraftAdapter(require_minestudio().MinecraftSim(**(options.model_extra or {})))


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
        self.observation_space = gym.spaces.Dict({"image": image_space or gym.spaces.Box(0, 255, (128, 128, 3), np.uint8)})
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
