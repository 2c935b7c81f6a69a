"""Whole episodes of a loaded policy: what ``mineonline eval`` (``driver/evaluate.py``) and the evaluator
actor of a training run (``services/evaluator.py``) both play and summarise.

An episode is played with the policy in eval mode, one observation at a time, keeping its recurrent
state; its record holds the return, the length, Crafter's achievements and MineStudio's reward events,
and the frames, returns and values a video needs when asked.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import numpy as np
import torch

from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS, crafter_score
from mineonline_core.config import OnlineConfig
from mineonline_core.errors import ConfigError
from mineonline_core.contracts.envs import clip_action
from mineonline_core.contracts.columns import Outputs
from mineonline_core.contracts.tree import to_numpy, to_torch, tree_map

# Evaluation episodes reset with seeds seed + EVAL_SEED_OFFSET + i, held out from rollout's (seed + worker, env),
# alike while training (``services/evaluator.py``) and in ``mineonline eval`` (``driver/evaluate.py``).
EVAL_SEED_OFFSET = 1_000_000
# The event counters MineStudio's MinecraftSim reports in ``info`` (``info[event][object] -> count``),
# which its RewardsCallback turns into rewards.
MINESTUDIO_EVENTS = ("mine_block", "craft_item", "use_item", "pickup", "drop", "break_item", "kill_entity")


class LoadedPolicy:
    """A checkpoint's policy with its weights, in eval mode, and what it needs to act."""

    def __init__(
        self,
        *,
        policy: torch.nn.Module,
        config: OnlineConfig,
        checkpoint: pathlib.Path | None,
        iteration: int,
        version: int,
        env_generator: Callable[[], Any],
    ) -> None:
        self.policy, self.config, self.checkpoint = policy, config, checkpoint
        self.iteration, self.version, self.env_generator = iteration, version, env_generator
        self.device = next(iter(policy.parameters()), torch.zeros(())).device
        self._observation_space: Any = None
        self._action_space: Any = None

    def make_env(self) -> Any:
        """The env the policy was trained in, adapted as during training (dict observations)."""
        from mineonline_core.contracts.envs import adapt_env

        return adapt_env(self.env_generator())

    @property
    def observation_space(self) -> Any:
        """The adapted env's observation space (a ``Dict``); the env is built once to learn it."""
        if self._observation_space is None:
            self._learn_spaces()
        return self._observation_space

    @observation_space.setter
    def observation_space(self, space: Any) -> None:
        self._observation_space = space

    @property
    def action_space(self) -> Any:
        """The adapted env's action space, whose bounds the actions returned are clipped to."""
        if self._action_space is None:
            self._learn_spaces()
        return self._action_space

    def _learn_spaces(self) -> None:
        env = self.make_env()
        try:
            self._observation_space, self._action_space = env.observation_space, env.action_space
        finally:
            env.close()

    def initial_state(self, batch_size: int = 1) -> Any:
        return self.policy.initial_state(batch_size)

    @torch.no_grad()
    def predict(
        self, observation: Any, state: Any = None, *, episode_start: Any = None, deterministic: bool = False
    ) -> tuple[Any, Any]:
        """Actions for one observation or a batch, as Stable-Baselines3's ``predict``: ``observation`` as
        the env returns it (gymnasium's array, MineStudio's dict) or as the adapted env does, with or
        without a leading batch axis; ``state`` what the last call returned (None: every env starts an
        episode); ``episode_start`` (N,) bools marking envs whose episode starts at this observation
        (their state is reset). Returns the actions (batched like ``observation``) and the next state."""
        actions, state, _ = self._forward(observation, state, episode_start, deterministic)
        return actions, state

    def step(self, obs: Any, state: Any = None, *, deterministic: bool = False) -> tuple[Any, Any, float]:
        """``act`` plus the value estimate of ``obs`` (in returns, denormalised)."""
        action, state, value = self._forward(obs, state, None, deterministic)
        return action, state, float(np.asarray(value).reshape(-1)[0])

    def act(self, obs: Any, state: Any = None, *, deterministic: bool = False) -> tuple[Any, Any]:
        """The action for one env's observation and the recurrent state to pass next time.

        ``state=None`` marks the first step of an episode (the policy starts from its initial
        state); pass the returned state back on every later step of the same episode.
        """
        action, state, _ = self._forward(obs, state, None, deterministic)
        return action, state

    @torch.no_grad()
    def _forward(self, observation: Any, state: Any, episode_start: Any, deterministic: bool) -> tuple[Any, Any, Any]:
        obs, batched = self._policy_input(observation)
        n = len(next(iter(obs.values())))
        if state is None:
            state, first = self.initial_state(n), np.ones(n, dtype=bool)
        else:
            first = np.zeros(n, dtype=bool) if episode_start is None else np.asarray(episode_start, dtype=bool)
            if first.shape != (n,):
                raise ConfigError(f"episode_start has shape {first.shape}; give one bool per observation: ({n},).")
        batch = to_torch(tree_map(lambda x: x[:, None], obs), self.device)
        context = {"first": torch.as_tensor(first, device=self.device)[:, None]}
        latents, state = self.policy(input=batch, state_in=state, context=context)
        head = self.policy.pi_head
        action = (
            head.sample(latents[Outputs.PI_LOGITS], deterministic=True)
            if deterministic
            else head.sample(latents[Outputs.PI_LOGITS])
        )
        value = to_numpy(self.policy.value_head.denormalize(latents[Outputs.VPRED]).reshape(n))
        # The env gets the sampled action clipped to its bounds (a Gaussian head's samples have none).
        action = clip_action(tree_map(lambda a: a[:, 0], to_numpy(action)), self.action_space)
        return (action, state, value) if batched else (tree_map(lambda a: a[0], action), state, value[0])

    def _policy_input(self, observation: Any) -> tuple[dict[str, np.ndarray], bool]:
        """The adapted observation, (N, ...) per key, and whether it came with a batch axis."""
        space = self.observation_space
        if not isinstance(observation, dict):  # a Box env's raw observation: the adapter's one key
            observation = {next(iter(space.spaces)): observation}
        missing = [key for key in space.spaces if key not in observation]
        if missing:
            raise ConfigError(
                f"the observation has no key {missing[0]!r}; the policy takes {sorted(space.spaces)} (its keys: "
                f"{sorted(observation)}). Give the observation the env returns."
            )
        obs = {key: np.asarray(observation[key], dtype=space[key].dtype) for key in space.spaces}
        extra = {key: obs[key].ndim - len(space[key].shape) for key in obs}
        if set(extra.values()) not in ({0}, {1}) or any(
            tuple(obs[key].shape[extra[key] :]) != tuple(space[key].shape) for key in obs
        ):
            key = next(iter(obs))
            raise ConfigError(
                f"observation {key!r} has shape {obs[key].shape}; the policy takes {tuple(space[key].shape)}, or a "
                f"batch of them (N, {', '.join(map(str, space[key].shape))})."
            )
        batched = extra[next(iter(obs))] == 1
        return (obs if batched else {key: value[None] for key, value in obs.items()}), batched


def _event_counts(info: dict) -> dict[str, float]:
    """``{"kill_entity:cow": 3.0, ...}``: MineStudio's event counters in one step's ``info``."""
    out = {}
    for event in MINESTUDIO_EVENTS:
        counters = info.get(event)
        if isinstance(counters, dict):
            for obj, count in counters.items():
                try:
                    out[f"{event}:{obj}"] = float(np.asarray(count).reshape(-1)[0])
                except (TypeError, ValueError, IndexError):
                    continue
    return out


def run_episode(
    policy: LoadedPolicy, env: Any, *, deterministic: bool, seed: int | None, record: bool
) -> dict[str, Any]:
    """One whole episode; the record of it, with its frames, returns and values when ``record``."""
    if isinstance(policy, LoadedPolicy) and policy._observation_space is None:
        policy.observation_space = env.observation_space  # known here: no env built just to learn it
        policy._action_space = env.action_space
    obs, info = env.reset(seed=seed) if seed is not None else env.reset()
    start = _event_counts(info)
    counts, state, total, length = dict(start), None, 0.0, 0
    frames, returns, values = [], [], []
    while True:
        action, state, value = policy.step(obs, state, deterministic=deterministic)
        if record and isinstance(obs, dict) and "image" in obs:
            frames.append(np.asarray(obs["image"]).copy())
            values.append(value)
        obs, reward, terminated, truncated, info = env.step(action)
        total, length = total + float(reward), length + 1
        counts.update(_event_counts(info))
        if record and frames:
            returns.append(total)
        if terminated or truncated:
            break
    episode: dict[str, Any] = {
        "return": total,
        "length": length,
        "terminated": bool(terminated),
        "truncated": bool(truncated),
    }
    if info.get("achievements") is not None:
        episode["achievements"] = {k: int(v) for k, v in info["achievements"].items()}
    events = {k: v - start.get(k, 0.0) for k, v in counts.items() if v - start.get(k, 0.0) > 0}
    if events:
        episode["events"] = events
    if record:
        episode["_video"] = (frames, returns, values)
    return episode


def summarize(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Returns, lengths, Crafter's success rates and score, and MineStudio event counts per episode."""
    returns = np.array([e["return"] for e in episodes], dtype=np.float64)
    lengths = np.array([e["length"] for e in episodes], dtype=np.float64)
    out: dict[str, Any] = {
        "episodes": len(episodes),
        "return_mean": float(returns.mean()),
        "return_std": float(returns.std()),
        "return_min": float(returns.min()),
        "return_max": float(returns.max()),
        "length_mean": float(lengths.mean()),
    }
    achieved = [e["achievements"] for e in episodes if "achievements" in e]
    if achieved and set().union(*achieved) & set(CRAFTER_ACHIEVEMENTS):
        rates = {name: float(np.mean([a.get(name, 0) > 0 for a in achieved])) for name in CRAFTER_ACHIEVEMENTS}
        out["crafter"] = {"score": crafter_score(100.0 * r for r in rates.values()), "success_rates": rates}
    names = sorted(set().union(*(e.get("events", {}) for e in episodes)))
    if names:
        out["events_per_episode"] = {
            n: float(np.mean([e.get("events", {}).get(n, 0.0) for e in episodes])) for n in names
        }
    return out
