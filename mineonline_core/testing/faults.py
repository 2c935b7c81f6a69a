"""Deterministic fault injection for envs: exceptions, hangs and process death; and a run's metrics read
while it runs (``live_records``).

``FaultyEnv`` wraps any gymnasium env and, driven by a seed, raises in ``step``/``reset`` at a
given rate, returns a NaN reward or a NaN in the observation at a given rate, hangs (sleeps past the
collector's ``step_timeout``) at a given step, or SIGKILLs its own process at a given step. Envs run in
their own subprocess (``rollout/envproc.py``), so the factory ``FaultyEnvFactory`` is what a test passes
as an env function: its arguments are plain values, it pickles, and it builds the env inside the
subprocess.

Two things make faults testable across env rebuilds, which happen in fresh processes:

* ``state_dir``: a directory shared by every life of the env. Each build claims the next *life*
  number there (an ``O_EXCL`` file), and each injected fault leaves a marker file
  ``fault-<kind>-<life>-<step>``, so a test can count exactly what was injected
  (``injected_faults(state_dir)``) and compare it with the collector's counters.
* ``once=True``: the ``*_at_step`` faults fire in the first life only; later lives run clean, so
  a test sees one fault, one rebuild and then steady collection. Lives are numbered across every
  env sharing ``state_dir``: give all envs of a worker one factory and exactly one env (the first
  built) gets the scheduled fault, while the others show what "untouched" means.

The random draws use ``numpy.random.default_rng([seed, life])``: the same seed gives the same
faults in the same lives, and a rebuilt env does not replay its predecessor's sequence.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import gymnasium as gym
import numpy as np

KINDS = ("step_error", "reset_error", "hang", "kill", "nan_reward", "nan_obs")


class InjectedFault(RuntimeError):
    """The exception ``FaultyEnv`` raises on purpose."""


def _claim_life(state_dir: str | None) -> int:
    """The number of this build of the env: 0, 1, 2, ... across processes sharing ``state_dir``."""
    if state_dir is None:
        return 0
    Path(state_dir).mkdir(parents=True, exist_ok=True)
    life = 0
    while True:
        try:
            os.close(os.open(os.path.join(state_dir, f"life-{life}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return life
        except FileExistsError:
            life += 1


def injected_faults(state_dir: str | os.PathLike) -> dict[str, int]:
    """How many faults of each kind were injected by envs sharing ``state_dir`` (plus ``lives``)."""
    counts = dict.fromkeys(KINDS, 0)
    counts["lives"] = 0
    for path in Path(state_dir).iterdir():
        if path.name.startswith("life-"):
            counts["lives"] += 1
        elif path.name.startswith("fault-"):
            kind = path.name.split("-")[1]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


class FaultyEnv(gym.Wrapper):
    """Injects faults into ``env``; every ``*_at_step`` counts the env's steps in this life from 1.

    ``guard_pid``: a process that must never be killed (the test runner): in it a ``kill`` fault
    raises instead, so a misconfigured test cannot take pytest down.
    """

    def __init__(
        self,
        env: gym.Env,
        *,
        seed: int = 0,
        step_error_rate: float = 0.0,
        reset_error_rate: float = 0.0,
        reset_error_after_end: bool = False,
        nan_reward_rate: float = 0.0,
        nan_obs_rate: float = 0.0,
        raise_at_step: int | None = None,
        hang_at_step: int | None = None,
        hang_s: float = 3600.0,
        kill_at_step: int | None = None,
        once: bool = False,
        state_dir: str | None = None,
        guard_pid: int | None = None,
    ) -> None:
        super().__init__(env)
        rates = {
            "step_error_rate": step_error_rate,
            "reset_error_rate": reset_error_rate,
            "nan_reward_rate": nan_reward_rate,
            "nan_obs_rate": nan_obs_rate,
        }
        for key, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{key}={rate}: a probability per call, in [0, 1]")
        self.step_error_rate, self.reset_error_rate = step_error_rate, reset_error_rate
        self.reset_error_after_end = reset_error_after_end  # every reset but a life's first one raises
        self.nan_reward_rate, self.nan_obs_rate = nan_reward_rate, nan_obs_rate
        self.raise_at_step, self.hang_at_step, self.kill_at_step = raise_at_step, hang_at_step, kill_at_step
        self.hang_s, self.state_dir, self.guard_pid = hang_s, state_dir, guard_pid
        self.life = _claim_life(state_dir)
        self.scheduled = not (once and self.life > 0)
        self.rng = np.random.default_rng([seed, self.life])
        self.steps = 0

    def _mark(self, kind: str) -> None:
        if self.state_dir is not None:
            Path(self.state_dir, f"fault-{kind}-{self.life}-{self.steps}").touch()

    def reset(self, **kwargs: Any) -> Any:
        if self.reset_error_after_end and self.steps:
            self._mark("reset_error")
            raise InjectedFault(f"injected reset fault after an episode end (life {self.life}, step {self.steps})")
        if self.reset_error_rate and self.rng.random() < self.reset_error_rate:
            self._mark("reset_error")
            raise InjectedFault(f"injected reset fault (life {self.life}, after step {self.steps})")
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        self.steps += 1
        at = self.steps if self.scheduled else None
        if at is not None and at == self.kill_at_step:
            self._mark("kill")
            if os.getpid() == self.guard_pid:
                raise InjectedFault("kill fault requested in the guarded process: run the env in a subprocess")
            os.kill(os.getpid(), signal.SIGKILL)
        if at is not None and at == self.hang_at_step:
            self._mark("hang")
            time.sleep(self.hang_s)  # the parent's step_timeout must fire first
        raise_now = at is not None and at == self.raise_at_step
        # Draw every step, even when a scheduled fault fires, so one seed gives one sequence.
        if (self.step_error_rate and self.rng.random() < self.step_error_rate) or raise_now:
            self._mark("step_error")
            raise InjectedFault(f"injected step fault (life {self.life}, step {self.steps})")
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self.nan_reward_rate and self.rng.random() < self.nan_reward_rate:
            self._mark("nan_reward")
            reward = float("nan")
        if self.nan_obs_rate and self.rng.random() < self.nan_obs_rate:
            self._mark("nan_obs")
            obs = _poison(obs)
        return obs, reward, terminated, truncated, info


def _poison(obs: Any) -> Any:
    """``obs`` with a NaN in the first element of every floating-point leaf."""
    from mineonline_core.contracts.tree import tree_map

    def nan_first(leaf: Any) -> Any:
        arr = np.array(leaf, copy=True)
        if arr.dtype.kind == "f" and arr.size:
            arr.reshape(-1)[0] = np.nan
        return arr

    return tree_map(nan_first, obs)


class FaultyEnvFactory:
    """A picklable env function: ``FaultyEnv(env_fn(), **faults)``, built in the env's subprocess.

    The process that creates the factory is guarded against ``kill`` faults by default.
    """

    def __init__(self, env_fn: Callable[[], gym.Env], **faults: Any) -> None:
        faults.setdefault("guard_pid", os.getpid())
        self.env_fn, self.faults = env_fn, faults

    def __call__(self) -> gym.Env:
        return FaultyEnv(self.env_fn(), **self.faults)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.faults.items() if k != "guard_pid")
        return f"FaultyEnvFactory({getattr(self.env_fn, '__name__', self.env_fn)!r}, {options})"


# ---------------------------------------------------------------------------------------------
# Checks on collected data: nothing lost, nothing torn, episodes closed where faults hit
# ---------------------------------------------------------------------------------------------


def stream_report(fragments: list[dict]) -> dict[str, dict[str, Any]]:
    """Per stream: fragment indices, missing indices (gaps), steps, and episode-boundary consistency.

    Consistency: a step is ``first`` exactly when the step before it (in the stream, across
    fragment boundaries) ended an episode, terminated or truncated. ``broken_boundaries`` counts
    violations; a lost or reordered fragment, or an episode not closed at a fault, shows up there.
    """
    from mineonline_core.contracts import fragment as F

    by_stream: dict[str, list[dict]] = {}
    for frag in fragments:
        by_stream.setdefault(frag[F.STREAM], []).append(frag)
    out: dict[str, dict[str, Any]] = {}
    for stream, frags in sorted(by_stream.items()):
        frags.sort(key=lambda f: f[F.INDEX])
        indices = [int(f[F.INDEX]) for f in frags]
        missing = sorted(set(range(indices[0], indices[-1] + 1)) - set(indices))
        first = np.concatenate([f[F.FIRST] for f in frags])
        ended = np.concatenate([f[F.TERMINATED] | f[F.TRUNCATED] for f in frags])
        broken = int(np.sum(first[1:] != ended[:-1])) if not missing else -1
        out[stream] = {
            "indices": indices,
            "missing": missing,
            "steps": int(first.size),
            "broken_boundaries": broken,
            "truncated": int(sum(int(np.sum(f[F.TRUNCATED])) for f in frags)),
            "terminated": int(sum(int(np.sum(f[F.TERMINATED])) for f in frags)),
        }
    return out


def live_records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s ``metrics.jsonl`` as its run is writing it: whole lines only. The line being
    written is left for the next read (a fault test that parsed it failed on a half-written record)."""
    from mineonline_core.builtin.console import METRICS_FILE

    path = Path(run_dir) / METRICS_FILE
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in data[: data.rfind("\n") + 1].splitlines() if line.strip()]
