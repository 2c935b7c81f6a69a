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
from mineonline_core.contracts.tree import to_numpy, to_torch, tree_map

# The event counters MineStudio's MinecraftSim reports in ``info`` (``info[event][object] -> count``),
# which its RewardsCallback turns into rewards.
# Evaluation episodes reset with seeds seed + EVAL_SEED_OFFSET + i, held out from rollout's (seed + worker, env),
# alike while training (``services/evaluator.py``) and in ``mineonline eval`` (``driver/evaluate.py``).
EVAL_SEED_OFFSET = 1_000_000
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

    def make_env(self) -> Any:
        """The env the policy was trained in, adapted as during training (dict observations)."""
        from mineonline_core.contracts.envs import adapt_env

        return adapt_env(self.env_generator())

    def initial_state(self, batch_size: int = 1) -> Any:
        return self.policy.initial_state(batch_size)

    @torch.no_grad()
    def step(self, obs: Any, state: Any = None, *, deterministic: bool = False) -> tuple[Any, Any, float]:
        """``act`` plus the value estimate of ``obs`` (in returns, denormalised)."""
        first = state is None
        if first:
            state = self.initial_state(1)
        batch = to_torch(tree_map(lambda x: np.asarray(x)[None, None], obs), self.device)
        context = {"first": torch.tensor([[first]], device=self.device)}
        latents, state = self.policy(input=batch, state_in=state, context=context)
        head = self.policy.pi_head
        action = (
            head.sample(latents["pi_logits"], deterministic=True)
            if deterministic
            else head.sample(latents["pi_logits"])
        )
        value = float(self.policy.value_head.denormalize(latents["vpred"]).reshape(-1)[0])
        return tree_map(lambda a: a[0, 0], to_numpy(action)), state, value

    def act(self, obs: Any, state: Any = None, *, deterministic: bool = False) -> tuple[Any, Any]:
        """The action for one env's observation and the recurrent state to pass next time.

        ``state=None`` marks the first step of an episode (the policy starts from its initial
        state); pass the returned state back on every later step of the same episode.
        """
        action, state, _ = self.step(obs, state, deterministic=deterministic)
        return action, state


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
