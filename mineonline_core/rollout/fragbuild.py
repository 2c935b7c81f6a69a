"""Small helpers of the collector: the per-env fragment under construction, timers, video capture.

A ``FragmentBuilder`` preallocates its columns on the first step (sized from that observation and
action), so assembling a fragment writes into arrays instead of growing Python lists per step.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import numpy as np

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.tree import tree_map

log = logging.getLogger(__name__)


class FragmentBuilder:
    """One fragment of one env, filled step by step. Steps are *recorded* when the policy acts and
    *completed* when the env answers; a truncated step also waits for its bootstrap value."""

    def __init__(self, *, length: int, stream: str, index: int, worker_id: int, env_id: int) -> None:
        self.length, self.stream, self.index = length, stream, index
        self.worker_id, self.env_id = worker_id, env_id
        self.n = 0  # steps recorded
        self.done = 0  # steps completed
        self.pending_bootstraps = 0
        self.obs: Any = None
        self.action: Any = None
        self.ref_logits: Any = None  # allocated at the first step that brings the reference's logits
        self.state_in: Any = None
        self.ref_state_in: Any = None
        self.ref_from = 0  # the first step whose reference logits were recorded
        self.next_obs: Any = None
        self.reward = np.zeros(length, np.float32)
        self.logprob = np.zeros(length, np.float32)
        self.vpred = np.zeros(length, np.float32)
        self.bootstrap = np.zeros(length, np.float32)
        self.terminated = np.zeros(length, bool)
        self.truncated = np.zeros(length, bool)
        self.first = np.zeros(length, bool)
        self.episode_id = np.zeros(length, np.int64)
        self.version = np.zeros(length, np.int64)

    def _alloc(self, tree: Any) -> Any:
        return tree_map(lambda x: np.empty((self.length, *np.shape(x)), np.asarray(x).dtype), tree)

    def record(
        self,
        *,
        obs: Any,
        action: Any,
        logprob: float,
        vpred: float,
        first: bool,
        version: int,
        episode_id: int,
        ref_logits: Any = None,
    ) -> int:
        """Write the policy's half of a step (and the KL reference's logits, when one ran); returns its index."""
        t = self.n
        if t == 0:
            self.obs, self.action = self._alloc(obs), self._alloc(action)
        tree_map(lambda buf, x: buf.__setitem__(t, x), self.obs, obs)
        tree_map(lambda buf, x: buf.__setitem__(t, x), self.action, action)
        if ref_logits is not None:
            if self.ref_logits is None:
                # Zeros before a reference arrived mid-fragment; ``build`` then leaves the column out.
                self.ref_logits = tree_map(lambda x: np.zeros((self.length, *np.shape(x)), np.float32), ref_logits)
                self.ref_from = t
            tree_map(lambda buf, x: buf.__setitem__(t, x), self.ref_logits, ref_logits)
        self.logprob[t], self.vpred[t], self.first[t] = logprob, vpred, first
        self.version[t], self.episode_id[t] = version, episode_id
        self.n += 1
        return t

    def complete(self, t: int, *, reward: float, terminated: bool, truncated: bool) -> None:
        """Write the env's half of step ``t``."""
        self.reward[t], self.terminated[t], self.truncated[t] = reward, terminated, truncated
        self.done += 1

    def obs_at(self, t: int) -> Any:
        return tree_map(lambda buf: buf[t], self.obs)

    def set_next_obs(self, obs: Any) -> None:
        self.next_obs = tree_map(lambda x: np.asarray(x)[None].copy(), obs)

    def complete_fragment(self) -> bool:
        return self.done == self.length and self.pending_bootstraps == 0

    def build(self) -> dict[str, Any]:
        fragment = {
            F.OBS: self.obs,
            F.NEXT_OBS: self.next_obs,
            F.ACTION: self.action,
            F.REWARD: self.reward,
            F.TERMINATED: self.terminated,
            F.TRUNCATED: self.truncated,
            F.FIRST: self.first,
            F.LOGPROB: self.logprob,
            F.VPRED: self.vpred,
            F.BOOTSTRAP: self.bootstrap,
            F.STATE_IN: self.state_in,
            F.REF_STATE_IN: self.ref_state_in,
            F.EPISODE_ID: self.episode_id,
            F.VERSION: self.version,
            F.STREAM: self.stream,
            F.INDEX: self.index,
            F.WORKER_ID: self.worker_id,
            F.ENV_ID: self.env_id,
        }
        # Only a column the reference filled from step 0 on: training runs the reference for the others.
        if self.ref_logits is not None and self.ref_from == 0:
            fragment[F.REF_LOGITS] = self.ref_logits
        return fragment


class Timers:
    """Thread-safe sums and counts; ``drain`` returns the means since the previous drain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self._sum[key] += value
            self._count[key] += 1

    def drain(self) -> dict[str, float]:
        with self._lock:
            out = {k: self._sum[k] / self._count[k] for k in self._sum if self._count[k]}
            self._sum.clear()
            self._count.clear()
        return out


class VideoRecorder:
    """Captures ``obs["image"]`` of one env's next whole episode, with returns and values."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: set[int] = set()
        self._active: dict[int, dict[str, list]] = {}
        self._done: list[dict] = []

    def arm(self, env_id: int) -> None:
        with self._lock:
            self._armed.add(env_id)

    def step(self, env_id: int, obs: Any, value: float, first: bool) -> None:
        if not self._armed and not self._active:
            return
        with self._lock:
            if env_id in self._armed and first:
                self._armed.discard(env_id)
                if not isinstance(obs, dict) or "image" not in obs:
                    log.info("video requested but env %d has no obs['image']; skipped", env_id)
                    return
                self._active[env_id] = {"frames": [], "values": [], "returns": []}
            rec = self._active.get(env_id)
            if rec is not None:
                rec["frames"].append(np.asarray(obs["image"]).copy())
                rec["values"].append(value)

    def reward(self, env_id: int, episode_return: float) -> None:
        rec = self._active.get(env_id)
        if rec is not None:
            rec["returns"].append(episode_return)

    def episode_end(self, env_id: int, episode_return: float) -> None:
        with self._lock:
            rec = self._active.pop(env_id, None)
            if rec is None:
                return
            while len(rec["returns"]) < len(rec["frames"]):  # an env crash lost the last reward
                rec["returns"].append(episode_return)
            self._done.append({"env_id": env_id, "episode_return": episode_return, **rec})

    def drain(self) -> list[dict]:
        with self._lock:
            out, self._done = self._done, []
        return out
