"""Plain models of the rollout side's numbers, for tests/oracle/test_rollout_oracle.py.

``replay_stream`` is a single-process rollout loop written from the fragment contract
(``contracts/fragment.py``) and DESIGN §5.2-§5.5: one env, one step at a time, the policy run on one
row with its own recurrent state, reset at every episode start. It replays the actions a collector
sampled (sampling is random; everything else is determined by the env, the weights and the actions)
and says what every per-step column, every fragment's start states and every episode record must be.

``PlainBuffer`` is the replay buffer's bookkeeping (DESIGN §4, ``rollout/buffer.py``'s rules) as a
list of dicts: chunks of consecutive fragments, staleness of a chunk from its oldest step, reuse,
eviction and the serving order.

Neither shares code with the product beyond the policy module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn


def _row(obs: dict) -> dict:
    return {k: torch.as_tensor(np.asarray(v))[None, None] for k, v in obs.items()}


def _value(policy: nn.Module, latents: dict) -> float:
    """The denormalised value: the head's output times the running std plus the running mean."""
    head, raw = policy.value_head, float(latents["vpred"].reshape(-1)[0])
    if not getattr(head, "use_normalizer", False):
        return raw
    norm = head.normalizer
    debias = max(float(norm.debiasing_term), norm.epsilon)
    mean = float(norm.running_mean[0]) / debias
    var = max(float(norm.running_mean_sq[0]) / debias - mean * mean, 1e-2)
    return raw * var**0.5 + mean


def _copy_state(state: Any) -> Any:
    return None if state is None else [np.array(h.detach().numpy(), copy=True) for h in state]


@torch.no_grad()
def replay_stream(
    *,
    env_fn: Callable[[], Any],
    fragments: list[dict],
    policies: dict[int, nn.Module],
    reference: nn.Module | None,
    discount: float,
    lost_errors: tuple[type[BaseException], ...] = (),
) -> tuple[list[dict], list[dict]]:
    """What each fragment of one stream must hold, and the episodes that ended in them.

    ``fragments`` are the stream's fragments in index order; their ``action`` and ``version`` columns
    drive the replay (the version picks the weights in ``policies``). An env step that raises one of
    ``lost_errors`` is the lost-env case: the step closes as truncated with reward 0 and its own value as
    bootstrap, the episode ends truncated without that step, and a fresh env is built."""
    env = env_fn()
    obs, info = env.reset()
    task = (info or {}).get("task")
    first, episode_id = True, 0
    state = ref_state = None
    ep_return = ep_disc = 0.0
    ep_len = 0
    expected, episodes = [], []

    def close_episode(truncated: bool) -> None:
        nonlocal ep_return, ep_disc, ep_len, episode_id
        if ep_len:
            episodes.append(
                {
                    "return": ep_return,
                    "discounted_return": ep_disc,
                    "length": ep_len,
                    "truncated": truncated,
                    "task": task,
                }
            )
        ep_return = ep_disc = 0.0
        ep_len = 0
        episode_id += 1

    for frag in fragments:
        length = len(frag["reward"])
        cols = {k: [] for k in ("obs", "reward", "terminated", "truncated", "first", "logprob", "vpred")}
        cols.update({"bootstrap": [], "episode_id": [], "bootstrap_choices": []})
        start_states = None
        for t in range(length):
            version = int(frag["version"][t])
            policy = policies[version]
            if first:
                state = policy.initial_state(1)
                ref_state = reference.initial_state(1) if reference is not None else None
            if t == 0:
                start_states = (_copy_state(state), _copy_state(ref_state))
            flag = torch.tensor([[first]])
            latents, state = policy(input=_row(obs), state_in=state, context={"first": flag})
            if reference is not None:
                _, ref_state = reference(input=_row(obs), state_in=ref_state, context={"first": flag})
            action = torch.as_tensor(np.asarray(frag["action"][t]))[None, None]
            cols["obs"].append(obs)
            cols["first"].append(first)
            cols["episode_id"].append(episode_id)
            cols["logprob"].append(float(policy.pi_head.logprob(action, latents["pi_logits"]).reshape(-1)[0]))
            value = _value(policy, latents)
            cols["vpred"].append(value)
            try:
                next_obs, reward, terminated, truncated, info = env.step(int(np.asarray(frag["action"][t])))
            except lost_errors:
                cols["reward"].append(0.0), cols["terminated"].append(False), cols["truncated"].append(True)
                cols["bootstrap"].append(value), cols["bootstrap_choices"].append([value])
                close_episode(truncated=True)
                env = env_fn()
                obs, info = env.reset()
                task = (info or {}).get("task", task)
                first, final_obs = True, cols["obs"][-1]
                continue
            truncated = bool(truncated) and not terminated  # a true terminal is never bootstrapped
            ep_return += reward
            ep_disc += discount**ep_len * reward
            ep_len += 1
            cols["reward"].append(float(reward))
            cols["terminated"].append(bool(terminated))
            cols["truncated"].append(truncated)
            choices = [0.0]
            if truncated:  # the value of the final observation under the state this step reached
                choices = [
                    _value(p, p(input=_row(next_obs), state_in=state, context={"first": torch.tensor([[False]])})[0])
                    for v, p in sorted(policies.items())
                    if v >= version
                ]
            cols["bootstrap"].append(choices[0]), cols["bootstrap_choices"].append(choices)
            final_obs = next_obs
            if terminated or truncated:
                close_episode(truncated=truncated)
                next_obs, info = env.reset()
                task = (info or {}).get("task", task)
            first, obs = terminated or truncated, next_obs
        expected.append(
            {
                **{k: np.asarray(v) for k, v in cols.items() if k not in ("obs", "bootstrap_choices")},
                "obs": cols["obs"],
                "bootstrap_choices": cols["bootstrap_choices"],
                "state_in": start_states[0],
                "ref_state_in": start_states[1],
                "next_obs": final_obs,
            }
        )
    env.close()
    return expected, episodes


def plain_episode_summary(episodes: list[dict]) -> dict[str, float]:
    """The window statistics a user reads, computed as their names say."""
    returns = [e["return"] for e in episodes]
    n = len(returns)
    mean = sum(returns) / n
    return {
        "episode/count": float(n),
        "episode/return_mean": mean,
        "episode/return_std": (sum((r - mean) ** 2 for r in returns) / n) ** 0.5,
        "episode/return_min": min(returns),
        "episode/return_max": max(returns),
        "episode/discounted_return_mean": sum(e["discounted_return"] for e in episodes) / n,
        "episode/length_mean": sum(e["length"] for e in episodes) / n,
        "episode/truncated_frac": sum(1.0 for e in episodes if e["truncated"]) / n,
    }


class PlainBuffer:
    """The replay buffer's bookkeeping, plainly (see the module doc)."""

    def __init__(self, *, max_chunks: int, max_reuse: int, max_staleness: int, fragments_per_chunk: int) -> None:
        self.max_chunks, self.max_reuse, self.max_staleness = max_chunks, max_reuse, max_staleness
        self.per_chunk = fragments_per_chunk
        self.version = 0
        self.chunks: list[dict] = []  # servable, oldest first
        self.pending: dict[str, list[dict]] = {}
        self.added = 0
        self.counts = {"dropped_stale": 0, "dropped_gap": 0, "evicted": 0, "used_up": 0, "chunks_served": 0}

    def _too_old(self, oldest_step: int, at: int | None = None) -> bool:
        newest_model = max(self.version, at if at is not None else 0)
        return newest_model - oldest_step > self.max_staleness

    def add(self, stream: str, index: int, step_versions: list[int]) -> None:
        self.added += 1
        waiting = self.pending.setdefault(stream, [])
        if waiting and waiting[-1]["index"] != index - 1:
            self.counts["dropped_gap"] += len(waiting)
            waiting.clear()
        if self._too_old(min(step_versions)):
            self.counts["dropped_stale"] += 1 + len(waiting)
            waiting.clear()
            return
        waiting.append({"stream": stream, "index": index, "steps": list(step_versions)})
        if len(waiting) == self.per_chunk:
            self.chunks.append(
                {
                    "chunk_id": f"{stream}.{waiting[0]['index']:09d}",
                    "version": min(v for f in waiting for v in f["steps"]),
                    "reuse": 0,
                    "rounds": set(),
                    "order": self.added,
                }
            )
            waiting.clear()
            while len(self.chunks) > self.max_chunks:
                self.chunks.pop(0)
                self.counts["evicted"] += 1

    def set_version(self, version: int) -> None:
        self.version = version
        for chunk in [c for c in self.chunks if self._too_old(c["version"])]:
            self.chunks.remove(chunk)
            self.counts["dropped_stale"] += self.per_chunk
        for waiting in self.pending.values():
            if waiting and self._too_old(min(v for f in waiting for v in f["steps"])):
                self.counts["dropped_stale"] += len(waiting)
                waiting.clear()

    def eligible(self, at: int | None) -> list[dict]:
        return [c for c in self.chunks if c["reuse"] < self.max_reuse and not self._too_old(c["version"], at)]

    def sample(self, k: int, at: int | None, round_id: int | None) -> list[tuple[str, int, int]]:
        """(chunk_id, version, times served): unserved in this round first, then freshest, least reused, oldest."""
        ranked = sorted(
            self.eligible(at), key=lambda c: (round_id in c["rounds"], -c["version"], c["reuse"], c["order"])
        )
        out = []
        for chunk in ranked[:k]:
            chunk["reuse"] += 1
            if round_id is not None:
                chunk["rounds"].add(round_id)
            out.append((chunk["chunk_id"], chunk["version"], chunk["reuse"]))
            if chunk["reuse"] >= self.max_reuse:
                self.chunks.remove(chunk)
                self.counts["used_up"] += 1
        self.counts["chunks_served"] += len(out)
        return out

    def stats(self) -> dict[str, float]:
        n = len(self.chunks)
        return {
            "replay/size": float(n),
            "replay/version": float(self.version),
            "replay/staleness_mean": sum(self.version - c["version"] for c in self.chunks) / n if n else 0.0,
            "replay/reuse_mean": sum(c["reuse"] for c in self.chunks) / n if n else 0.0,
            "replay/fragments_added": float(self.added),
            **{f"replay/{k}": float(v) for k, v in self.counts.items()},
        }
