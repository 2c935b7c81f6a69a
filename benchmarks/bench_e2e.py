"""End-to-end PPO throughput: ``mineonline run`` vs the plain synchronous loop vs Stable-Baselines3.

All three train the same network with the same hyperparameters (``_benchlib.PPO_SETTINGS``) on the
same env with the same number of envs. Each system runs in its own subprocess (``--system``) and
prints one JSON line; the parent prints the combined line. Figures per workload and system:

* ``env_steps_per_s``: env steps collected per wall second after the first (warm-up) iteration;
* ``samples_per_s``: learner samples (steps x epochs) optimised per wall second, same window;
* ``cpu_ms_per_env_step``: CPU seconds of the system's whole process tree (start-up included) per
  env step collected: what a run costs, nearly independent of how loaded the machine is;
* for mineonline, ``profile``: the mean of every ``perf/*`` metric the framework logged (env step,
  inference, fragment assembly, store write, buffer, fetch, GAE, forward/backward, broadcast), read
  from ``metrics.jsonl`` in the run directory.

Targets (issue 8): Crafter >= 1.5x SB3 and >= 1.0x plain; CartPole >= 1.0x SB3 and >= 1.0x plain.
SB3 runs only when importable (``run_all.py --sb3`` installs it into ``.venv-bench/``).
``MINEONLINE_BENCH_OVERRIDES`` (space-separated dotlist items) is appended to mineonline's overrides,
to try a rollout layout against the same baselines, e.g.
``rollout_config.num_rollout_workers=2 rollout_config.worker_config.num_envs=4``.

    python benchmarks/bench_e2e.py --workloads cartpole=40,cartpole-inline=40,crafter=8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import _benchlib as bl  # noqa: E402

SB3_SITE = bl.ROOT / ".venv-bench" / "site"


# ---------------------------------------------------------------------------------------------
# mineonline
# ---------------------------------------------------------------------------------------------


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise_run(records: list[dict], *, chunk_steps: int, epochs: int) -> dict:
    """Rates over the window from the first iteration's record to the last one, and the perf profile."""
    iters = [r for r in records if "trainer/iteration" in r]
    if len(iters) < 2:
        raise RuntimeError(f"metrics.jsonl holds {len(iters)} trainer iterations; need at least 2 for a rate")
    first, last = iters[0], iters[-1]
    wall = last["time"] - first["time"]
    n_iters = last["trainer/iteration"] - first["trainer/iteration"]
    env_steps = max(r["step"] for r in records if r["time"] <= last["time"]) - first["step"]
    profile: dict[str, list[float]] = {}
    for r in records:
        if r["time"] > first["time"]:
            for k, v in r.items():
                if k.startswith("perf/") and isinstance(v, (int, float)):
                    profile.setdefault(k, []).append(v)
    last_values = {k: v for k, v in last.items() if isinstance(v, (int, float)) and not k.startswith("perf/")}
    episode = {k: v for r in records for k, v in r.items() if k.startswith("episode/") and isinstance(v, (int, float))}
    return {
        "env_steps_per_s": env_steps / wall,
        "samples_per_s": n_iters * chunk_steps * epochs / wall,
        "consumed_steps_per_s": n_iters * chunk_steps / wall,
        "iterations_in_window": n_iters,
        "wall_s": wall,
        "profile": {k: float(np.mean(v)) for k, v in sorted(profile.items())},
        "trainer_last": {k: v for k, v in last_values.items() if k.startswith(("trainer/", "replay/"))},
        "episode": episode,
        "_env_steps_total": max(r["step"] for r in records),
    }


def run_mineonline(workload: str, iterations: int, num_envs: int | None, inline: bool) -> dict:
    from mineonline_core.driver.api import run

    s = bl.ppo_settings(workload)
    chunk_steps = s["batch_size_per_gpu"] * s["batches_per_iteration"] * s["fragment_length"]
    with tempfile.TemporaryDirectory(prefix="bench-e2e-") as tmp:
        name = f"e2e-{workload}"
        overrides = bl.online_overrides(
            workload, iterations=iterations + 1, run_name=name, output_dir=tmp, num_envs=num_envs, inline=inline
        )
        overrides += [o for o in os.environ.get("MINEONLINE_BENCH_OVERRIDES", "").split() if o]
        start = time.perf_counter()
        result = run({}, overrides, progress=False)
        total = time.perf_counter() - start
        summary = summarise_run(
            read_metrics(Path(tmp) / name), chunk_steps=chunk_steps, epochs=s["epochs_per_iteration"]
        )
    summary.update(status=result.get("status"), total_wall_s=total, env_steps_total=summary.pop("_env_steps_total"))
    return summary


# ---------------------------------------------------------------------------------------------
# Stable-Baselines3
# ---------------------------------------------------------------------------------------------


def _sb3_env(workload: str):  # noqa: ANN202 - module-level so SubprocVecEnv can pickle it
    import gymnasium as gym

    if workload == "cartpole":
        return gym.make("CartPole-v1")
    env = bl.env_generator("crafter")()
    return gym.wrappers.TransformObservation(env, lambda o: o["image"], env.observation_space["image"])


class _Sb3EnvFn:
    def __init__(self, workload: str) -> None:
        self.workload = workload

    def __call__(self):  # noqa: ANN204
        return _sb3_env(self.workload)


def sb3_envs(workload: str, num_envs: int, inline: bool):  # noqa: ANN201 - SB3 is imported late
    """SB3's vector env: ``DummyVecEnv`` steps in this process (``-inline``), ``SubprocVecEnv`` in subprocesses."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    fns = [_Sb3EnvFn(workload)] * num_envs
    return DummyVecEnv(fns) if inline else SubprocVecEnv(fns, start_method="forkserver")


def sb3_model(workload: str, envs, *, recurrent: bool):  # noqa: ANN001, ANN201 - SB3 is imported late
    """SB3 with the settings every system trains with (``_benchlib.PPO_SETTINGS``): on CartPole ``PPO`` with an
    MLP 64x64 tanh, separate torsos; on Crafter ``PPO("CnnPolicy")`` (the Nature CNN, as mineonline's ``cnn``),
    or with ``recurrent`` sb3-contrib's ``RecurrentPPO`` (Nature CNN + 256 embedding + an LSTM of 256: the
    closest SB3 has to our CNN + GRU)."""
    import torch
    from stable_baselines3 import PPO

    s = bl.ppo_settings(workload)
    common = dict(
        n_steps=s["fragment_length"],
        batch_size=s["batch_size_per_gpu"] * s["fragment_length"],
        n_epochs=s["epochs_per_iteration"],
        learning_rate=s["learning_rate"],
        gamma=s["discount"],
        gae_lambda=s["gae_lambda"],
        clip_range=s["ppo_clip"],
        ent_coef=s["entropy_bonus_coef"],
        vf_coef=s["ppo_vf_coef"],
        max_grad_norm=s["max_grad_norm"],
        seed=0,
        verbose=0,
        device="cpu",
    )
    optimizer = dict(eps=s["adam_eps"])
    if workload == "cartpole":
        mlp = dict(net_arch=dict(pi=[64, 64], vf=[64, 64]), activation_fn=torch.nn.Tanh, optimizer_kwargs=optimizer)
        return PPO("MlpPolicy", envs, policy_kwargs=mlp, **common)
    if not recurrent:
        return PPO("CnnPolicy", envs, policy_kwargs=dict(optimizer_kwargs=optimizer), **common)
    from sb3_contrib import RecurrentPPO

    lstm = dict(
        lstm_hidden_size=256,
        shared_lstm=True,
        enable_critic_lstm=False,
        features_extractor_kwargs=dict(features_dim=256),
        optimizer_kwargs=optimizer,
    )
    return RecurrentPPO("CnnLstmPolicy", envs, policy_kwargs=lstm, **common)


def sb3_name(model) -> str:  # noqa: ANN001
    return f"{type(model).__module__.split('.')[0]}.{type(model).__name__}({type(model.policy).__name__})"


def run_sb3(workload: str, iterations: int, num_envs: int | None, inline: bool) -> dict:
    """SB3's rates over ``iterations`` after a warm-up iteration; Crafter's model is the recurrent one."""
    sys.path.insert(0, str(SB3_SITE))
    s = bl.ppo_settings(workload)
    n = num_envs or s["num_envs"]
    envs = sb3_envs(workload, n, inline)
    model = sb3_model(workload, envs, recurrent=True)
    per_iter = n * s["fragment_length"]
    model.learn(per_iter)  # warm-up iteration
    start = time.perf_counter()
    model.learn(per_iter * iterations, reset_num_timesteps=False)
    wall = time.perf_counter() - start
    envs.close()
    steps = per_iter * iterations
    return {
        "env_steps_per_s": steps / wall,
        "samples_per_s": steps * s["epochs_per_iteration"] / wall,
        "wall_s": wall,
        "algo": sb3_name(model),
        "env_steps_total": per_iter * (iterations + 1),
    }


def sb3_available() -> bool:
    sys.path.insert(0, str(SB3_SITE))
    try:
        import sb3_contrib  # noqa: F401
        import stable_baselines3  # noqa: F401
    except ImportError:
        return False
    finally:
        sys.path.remove(str(SB3_SITE))
    return True


# ---------------------------------------------------------------------------------------------
# Orchestration: one subprocess per (system, workload)
# ---------------------------------------------------------------------------------------------


def child(system: str, workload: str, iterations: int, num_envs: int | None, inline: bool) -> None:
    import torch

    # One intra-op thread, as Ray gives each mineonline actor with num_cpus=1 (OMP_NUM_THREADS=1):
    # with more threads than free cores, OpenMP's spinning made a CartPole update 30x slower here.
    torch.set_num_threads(1)
    if system == "mineonline":
        out = run_mineonline(workload, iterations, num_envs, inline)
    elif system == "plain":
        import plain_ppo

        out = plain_ppo.run(workload, iterations=iterations, num_envs=num_envs, inline=inline)
        out["env_steps_total"] = out["env_steps"]
    else:
        out = run_sb3(workload, iterations, num_envs, inline)
    print("RESULT " + json.dumps(out), flush=True)


def spawn(system: str, workload: str, iterations: int, num_envs: int | None, timeout: float, inline: bool) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--system",
        system,
        "--workloads",
        workload,
        "--iterations",
        str(iterations),
        *(["--inline"] if inline else []),
    ]
    if num_envs:
        cmd += ["--num-envs", str(num_envs)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(bl.ROOT), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "disabled",
    }
    # CPU of the whole process tree (Ray's daemons and actors, env processes), sampled from /proc
    # every second, last value per pid: what a run costs, nearly independent of the machine's load.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cpu: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *bl.descendants(proc.pid)]:
                try:
                    cpu[pid] = bl.proc_cpu_s(pid)
                except (OSError, IndexError, ValueError):
                    pass
            if time.monotonic() > deadline:
                proc.terminate()  # the child we started, by its pid: it shuts its Ray cluster down
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
                return {"error": f"timed out after {timeout:.0f}s"}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
            out["cpu_s_total"] = sum(cpu.values())
            if out.get("env_steps_total"):
                out["cpu_ms_per_env_step"] = 1e3 * out["cpu_s_total"] / out["env_steps_total"]
            return out
    tail = (stderr or stdout).strip().splitlines()[-8:]
    return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads",
        default="cartpole=40,cartpole-inline=40,crafter",
        help="comma-separated NAME[-inline][=ITERATIONS]: -inline steps the envs in the stepping "
        "process (SyncVectorEnv, DummyVecEnv, env_processes=false) instead of subprocesses "
        "(AsyncVectorEnv, SubprocVecEnv, env_processes=true); ITERATIONS overrides --iterations",
    )
    parser.add_argument("--systems", default="mineonline,plain,sb3")
    parser.add_argument(
        "--iterations", type=int, default=10, help="measured iterations (one warm-up iteration is added)"
    )
    parser.add_argument("--num-envs", type=int, default=None)
    parser.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)  # internal: the child's placement
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per system and workload")
    parser.add_argument("--system", help=argparse.SUPPRESS)  # internal: run one system in this process
    parser.add_argument("--quick", action="store_true", help="CartPole, 6 iterations, mineonline and plain")
    args = parser.parse_args()
    if args.system:
        child(args.system, args.workloads, args.iterations, args.num_envs, args.inline)
        return
    if args.quick:
        args.workloads, args.systems, args.iterations, args.num_envs = "cartpole", "mineonline,plain", 6, 2
    systems = [s for s in args.systems.split(",") if s]
    if "sb3" in systems and not sb3_available():
        systems.remove("sb3")
        print("# SB3 not installed in .venv-bench/site: run `benchmarks/run_all.py --sb3` once", file=sys.stderr)
    results: dict = {}
    for token in [w for w in args.workloads.split(",") if w]:
        key, _, iterations = token.partition("=")
        workload, inline = key.removesuffix("-inline"), key.endswith("-inline")
        iterations = int(iterations or args.iterations)
        row = {system: spawn(system, workload, iterations, args.num_envs, args.timeout, inline) for system in systems}
        for base in ("plain", "sb3"):
            mine, other = row.get("mineonline", {}), row.get(base, {})
            if "env_steps_per_s" in mine and "env_steps_per_s" in other:
                row[f"env_steps_ratio_vs_{base}"] = mine["env_steps_per_s"] / other["env_steps_per_s"]
                row[f"samples_ratio_vs_{base}"] = mine["samples_per_s"] / other["samples_per_s"]
        row["iterations"] = iterations
        results[key] = row
        print(f"# {key}: {json.dumps(row)}", file=sys.stderr, flush=True)
    bl.emit(
        "e2e",
        {"results": results},
        iterations=args.iterations,
        systems=systems,
        quick=args.quick,
        targets={"crafter": {"vs_sb3": 1.5, "vs_plain": 1.0}, "cartpole": {"vs_sb3": 1.0, "vs_plain": 1.0}},
    )


if __name__ == "__main__":
    main()
