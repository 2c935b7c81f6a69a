"""Shared pieces of the benchmark scripts: workloads, the plain-process baseline, output, memory.

Every benchmark prints exactly one JSON line (``emit``) whose keys are stable, so ``run_all.py`` and
``tests/test_benchmarks_quick.py`` can read them. Nothing here is a project dependency: the module
lives next to the scripts and is imported as ``_benchlib`` (each script puts its folder on sys.path).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mineonline_core.contracts.envs import adapted  # noqa: E402
from mineonline_core.driver.proctable import stat_fields  # noqa: E402
from mineonline_core.builtin.envs import CrafterEnv, GymnasiumEnv  # noqa: E402
from mineonline_core.contracts.envs import env_generator_from_config  # noqa: E402
from mineonline_core.builtin.models import MLPPolicy, RecurrentCNNPolicy  # noqa: E402
from mineonline_core.contracts.policy import prepare_policy  # noqa: E402

WORKLOADS = ("crafter", "cartpole")


# ---------------------------------------------------------------------------------------------
# Workloads: the same env and network for mineonline, the plain loop and SB3
# ---------------------------------------------------------------------------------------------


def env_generator(workload: str) -> Callable[[], Any]:
    """A picklable zero-argument env factory (gymnasium, dict observations) for ``workload``."""
    if workload == "crafter":
        return adapted(env_generator_from_config(CrafterEnv, CrafterEnv.Config()))
    if workload == "cartpole":
        return adapted(env_generator_from_config(GymnasiumEnv, GymnasiumEnv.Config(id="CartPole-v1")))
    raise SystemExit(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def policy_config(workload: str) -> dict:
    """The ``policy_config`` section mineonline uses for ``workload`` (the default networks)."""
    return {"name": "cnn_gru"} if workload == "crafter" else {"name": "mlp"}


def build_policy(workload: str, env: Any, *, use_normalized_vf: bool = True) -> torch.nn.Module:
    """The same network mineonline builds from ``policy_config(workload)``."""
    cls = RecurrentCNNPolicy if workload == "crafter" else MLPPolicy
    policy = cls.build(cls.Config(), observation_space=env.observation_space, action_space=env.action_space)
    return prepare_policy(policy, use_normalized_vf=use_normalized_vf)


def env_config(workload: str) -> dict:
    return {"name": "crafter"} if workload == "crafter" else {"name": "gymnasium", "id": "CartPole-v1"}


# ---------------------------------------------------------------------------------------------
# The plain-process baseline: envs in subprocesses, one batched forward, nothing else
# ---------------------------------------------------------------------------------------------


def make_vector_env(workload: str, num_envs: int, *, inline: bool = False) -> Any:
    """gymnasium's ``AsyncVectorEnv`` over shared memory (``SyncVectorEnv`` in this process when
    ``inline``), resetting in the same step (as mineonline's envs do), so a step always moves every
    env forward."""
    import gymnasium as gym

    fn = env_generator(workload)
    if inline:
        return gym.vector.SyncVectorEnv([fn] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    return gym.vector.AsyncVectorEnv(
        [fn] * num_envs,
        shared_memory=True,
        context="forkserver",
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


class BatchedActor:
    """One batched policy step exactly as a rollout worker takes it: forward (B, 1), sample, log-prob,
    denormalised value, recurrent state carried and reset at episode starts."""

    def __init__(self, policy: torch.nn.Module, num_envs: int) -> None:
        self.policy = policy.eval()
        self.state = policy.initial_state(num_envs)
        self.first = torch.ones(num_envs, 1, dtype=torch.bool)

    @torch.no_grad()
    def act(self, obs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        inputs = {k: torch.as_tensor(v)[:, None] for k, v in obs.items()}
        latents, self.state = self.policy(inputs, self.state, {"first": self.first})
        logits = latents["pi_logits"]
        action = self.policy.pi_head.sample(logits)
        logprob = self.policy.pi_head.logprob(action, logits)
        vpred = self.policy.value_head.denormalize(latents["vpred"])
        return action[:, 0].numpy(), logprob[:, 0].numpy(), vpred.reshape(-1).numpy()

    def episode_ends(self, done: np.ndarray) -> None:
        self.first = torch.as_tensor(done, dtype=torch.bool)[:, None]


def ceiling_steps_per_s(workload: str, *, num_envs: int, seconds: float, warmup_steps: int = 20) -> dict:
    """Env steps/s of envs in subprocesses + the batched forward, in one plain process."""
    envs = make_vector_env(workload, num_envs)
    try:
        spaces = SimpleNamespace(observation_space=envs.single_observation_space, action_space=envs.single_action_space)
        policy = build_policy(workload, spaces)
        actor = BatchedActor(policy, num_envs)
        obs, _ = envs.reset(seed=0)
        infer_s = steps = 0
        start = None
        while True:
            if steps == warmup_steps * num_envs and start is None:
                start, cpu0, infer_s, steps = time.perf_counter(), time.process_time(), 0.0, 0
            t0 = time.perf_counter()
            action, _, _ = actor.act(obs)
            infer_s += time.perf_counter() - t0
            obs, _, terminated, truncated, _ = envs.step(action)
            actor.episode_ends(np.logical_or(terminated, truncated))
            steps += num_envs
            if start is not None and time.perf_counter() - start >= seconds:
                break
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    finally:
        envs.close()
    # CPU of this (the stepping) process per env step: stable under load, unlike the rate.
    return {
        "steps_per_s": steps / elapsed,
        "steps": steps,
        "seconds": elapsed,
        "inference_ms_per_batch": 1e3 * infer_s / max(steps / num_envs, 1),
        "cpu_ms_per_step": 1e3 * cpu / steps,
    }


# ---------------------------------------------------------------------------------------------
# Output and machine description
# ---------------------------------------------------------------------------------------------


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "host_cpus": os.cpu_count(),
        "load_1m": round(load[0], 2),
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def emit(bench: str, figures: dict, **extra: Any) -> dict:
    """Print the benchmark's one JSON line (and return it)."""
    record = {
        "bench": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        **machine(),
        **extra,
        **{k: _plain(v) for k, v in figures.items()},
    }
    print(json.dumps(record), flush=True)
    return record


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return round(float(value), 4)
    if isinstance(value, np.integer):
        return int(value)
    return value


# ---------------------------------------------------------------------------------------------
# Memory: /proc, no psutil needed
# ---------------------------------------------------------------------------------------------


def proc_status_kb(pid: int | None = None) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS) of ``pid`` (default: this process) in KiB; {} if gone."""
    try:
        text = Path(f"/proc/{pid or os.getpid()}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


def children_rss_kb(pid: int | None = None) -> int:
    """Summed RSS of ``pid``'s descendant processes (env subprocesses), in KiB."""
    total, stack, seen = 0, [pid or os.getpid()], set()
    while stack:
        parent = stack.pop()
        try:
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            if kid not in seen:
                seen.add(kid)
                total += proc_status_kb(kid).get("VmRSS", 0)
                stack.append(kid)
    return total


def init_local_ray(num_cpus: int | None = None) -> None:
    """A private local Ray cluster (never another engineer's), in mineonline's namespace."""
    import ray

    if not ray.is_initialized():
        env_vars = {k: os.environ[k] for k in ("PYTHONPATH", "WANDB_MODE") if k in os.environ}
        env_vars["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env_vars.get("PYTHONPATH")]))
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            include_dashboard=False,
            namespace="mineonline",
            log_to_driver=False,
            runtime_env={"env_vars": env_vars},
        )


# ---------------------------------------------------------------------------------------------
# PPO settings shared by ``mineonline run``, the plain loop and SB3 (one source of truth)
# ---------------------------------------------------------------------------------------------

PPO_SETTINGS = {
    # One iteration = num_envs x fragment_length env steps = chunks_per_iteration chunks.
    "cartpole": {
        "num_envs": 8,
        "fragment_length": 128,
        "batch_size_per_gpu": 2,
        "batches_per_iteration": 4,
        "epochs_per_iteration": 4,
        "learning_rate": 2.5e-4,
        "discount": 0.99,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "ppo_vf_coef": 0.5,
        "entropy_bonus_coef": 0.0,
        "max_grad_norm": 0.5,
        "weight_decay": 0.0,
        "adam_eps": 1e-5,
    },
    "crafter": {
        "num_envs": 8,
        "fragment_length": 64,
        "batch_size_per_gpu": 4,
        "batches_per_iteration": 2,
        "epochs_per_iteration": 3,
        "learning_rate": 3e-4,
        "discount": 0.99,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "ppo_vf_coef": 0.5,
        "entropy_bonus_coef": 0.01,
        "max_grad_norm": 0.5,
        "weight_decay": 0.0,
        "adam_eps": 1e-5,
    },
}


def ppo_settings(workload: str) -> dict:
    return dict(PPO_SETTINGS[workload])


def online_overrides(
    workload: str,
    *,
    iterations: int,
    run_name: str,
    output_dir: str,
    num_envs: int | None = None,
    batch_size: int | None = None,
    extra: dict | None = None,
    inline: bool = False,
) -> list[str]:
    """OmegaConf dotlist for ``mineonline_core.driver.api.run`` with ``PPO_SETTINGS[workload]``."""
    s = ppo_settings(workload)
    num_envs = num_envs or s["num_envs"]
    values = {
        "run_name": run_name,
        "output_dir": output_dir,
        "seed": 0,
        "env_config": env_config(workload),
        "policy_config": policy_config(workload),
        "logger_config.loggers": [],
        "rollout_config.num_rollout_workers": 1,
        "rollout_config.fragment_length": s["fragment_length"],
        "rollout_config.worker_config.num_envs": num_envs,
        "rollout_config.worker_config.batch_size": batch_size or num_envs,
        "rollout_config.worker_config.env_processes": not inline,
        "rollout_config.replay_buffer_config.max_reuse": 1,
        "rollout_config.replay_buffer_config.max_staleness": 1,
        "rollout_config.replay_buffer_config.fragments_per_chunk": 1,
        "train_config.num_workers": 1,
        "train_config.num_iterations": iterations,
        "train_config.context_length": s["fragment_length"],
        "train_config.gradient_accumulation": 1,
        "train_config.use_normalized_vf": False,
        "train_config.zero_initial_vf": False,
        "train_config.record_video_interval": 0,
        "train_config.save_interval": 10**6,
        "train_config.keep_interval": 10**6,
        **{
            f"train_config.{k}": s[k]
            for k in (
                "batch_size_per_gpu",
                "batches_per_iteration",
                "epochs_per_iteration",
                "learning_rate",
                "discount",
                "gae_lambda",
                "ppo_clip",
                "ppo_vf_coef",
                "entropy_bonus_coef",
                "max_grad_norm",
                "weight_decay",
                "adam_eps",
            )
        },
        **(extra or {}),
    }
    return [f"{k}={_dotlist_value(v)}" for k, v in values.items()]


def _dotlist_value(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)  # OmegaConf parses JSON-style flow collections
    return str(value).lower() if isinstance(value, bool) else str(value)


def descendants(root: int | None = None) -> list[int]:
    """Every descendant pid of ``root`` (default: this process), read from /proc."""
    out, stack = [], [root or os.getpid()]
    while stack:
        pid = stack.pop()
        try:
            kids = [
                int(k)
                for t in os.listdir(f"/proc/{pid}/task")
                for k in Path(f"/proc/{pid}/task/{t}/children").read_text().split()
            ]
        except OSError:
            continue
        out += kids
        stack += kids
    return out


def actor_pids(class_name: str) -> list[int]:
    """Pids of this driver's Ray actor processes of ``class_name`` (Ray titles them ``ray::<Class>``)."""
    found = []
    for pid in descendants():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith(f"ray::{class_name}"):
            found.append(pid)
    return found


def proc_start_and_cpu_s(pid: int) -> tuple[int, float]:
    """``pid``'s start time (clock ticks since boot: with the pid, it names one process) and its user + system
    CPU seconds (all its threads) so far."""
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)  # an OSError, as reading the file of a process that has gone raised
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (all its threads) so far."""
    return proc_start_and_cpu_s(pid)[1]
