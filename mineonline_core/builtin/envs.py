"""The core's env factories and the adapters that make any env meet the env contract
(``mineonline_core.contracts.envs``): a gymnasium env with dict observations.

Policies receive ``{"image": uint8 (H, W, 3)}`` for image envs and ``{"obs": float32 (...)}`` for
vector envs, so one policy contract covers CartPole, Crafter and Minecraft. ``adapt_env`` converts
old-gym 4-tuple envs (Crafter) and MineStudio's ``MinecraftSim`` (imported only when used); the
registered factories ``gymnasium``, ``crafter`` and ``minestudio`` build on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import gymnasium as gym
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from mineonline_core.contracts.envs import EnvFactory, MinecraftAdapter, adapt_env
from mineonline_core.errors import ConfigError

CRAFTER_ACHIEVEMENTS = (
    "collect_coal",
    "collect_diamond",
    "collect_drink",
    "collect_iron",
    "collect_sapling",
    "collect_stone",
    "collect_wood",
    "defeat_skeleton",
    "defeat_zombie",
    "eat_cow",
    "eat_plant",
    "make_iron_pickaxe",
    "make_iron_sword",
    "make_stone_pickaxe",
    "make_stone_sword",
    "make_wood_pickaxe",
    "make_wood_sword",
    "place_furnace",
    "place_plant",
    "place_stone",
    "place_table",
    "wake_up",
)


def crafter_score(success_rates_percent: Iterable[float]) -> float:
    """The Crafter score: ``exp(mean_i ln(1 + s_i)) - 1`` for success rates ``s_i`` in percent."""
    rates = np.asarray(list(success_rates_percent), dtype=np.float64)
    if rates.size == 0:
        return float("nan")
    return float(np.exp(np.mean(np.log1p(rates))) - 1.0)


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
            area=(options.area, options.area),
            size=(options.size, options.size),
            reward=options.reward,
            length=options.length,
            seed=options.seed,
        )
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
