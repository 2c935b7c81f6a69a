"""Whole-process wall clock to a fixed number of env steps: ``mineonline run`` vs Stable-Baselines3.

What a user compares: the time from typing the command to the end of the run, start-up and shutdown
included. Both run back to back in one sitting, each as its own process, with the same env, number
of envs, steps per rollout, epochs, minibatches and PPO hyperparameters (``_benchlib.PPO_SETTINGS``):

* ``cartpole``: 100k steps, CleanRL's settings (8 envs x 128 steps, 4 epochs, 4 minibatches of 256),
  MLP 64x64 tanh; SB3 ``PPO("MlpPolicy")``;
* ``crafter``: 50k steps, 8 envs x 64 steps, 3 epochs, 2 minibatches of 256; SB3 ``PPO("CnnPolicy")``
  (Nature CNN); mineonline's ``cnn`` (the same Nature CNN, feed-forward; issue 19).

For SB3 the figures are split into ``setup_s`` (imports, envs, model) and ``learn_s``
(``model.learn``); for mineonline ``bench_startup.run_cli`` gives first env step, first iteration,
shutdown and whole. Envs run in subprocesses for both (``SubprocVecEnv``, mineonline's env
processes); ``NAME-inline`` steps them in the stepping process (``DummyVecEnv``, ``env_processes:
false``). Targets (issue 16): CartPole whole <= 1.0x SB3's, Crafter whole <= 0.67x SB3's.
SB3 comes from ``.venv-bench/site`` (``run_all.py --sb3`` installs it).

    python benchmarks/bench_whole.py                                  # cartpole and cartpole-inline
    python benchmarks/bench_whole.py --workloads crafter              # 50k Crafter steps (minutes)
    python benchmarks/bench_whole.py --workloads cartpole=20000       # a shorter budget
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _benchlib as bl  # noqa: E402
import bench_startup  # noqa: E402

SB3_SITE = bl.ROOT / ".venv-bench" / "site"
DEFAULT_STEPS = {"cartpole": 100_000, "crafter": 50_000}


def sb3_child(workload: str, steps: int, inline: bool) -> None:
    """Runs in its own process: SB3 set-up and learning, timed from the interpreter's start."""
    start = time.time()
    sys.path.insert(0, str(SB3_SITE))
    import torch
    from bench_e2e import sb3_envs, sb3_model, sb3_name

    torch.set_num_threads(1)  # as bench_e2e: more threads than free cores made updates 30x slower here
    envs = sb3_envs(workload, bl.ppo_settings(workload)["num_envs"], inline)
    model = sb3_model(workload, envs, recurrent=False)
    ready = time.time()
    model.learn(steps)
    done = time.time()
    envs.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "setup_s": ready - start,
                "learn_s": done - ready,
                "env_steps": int(model.num_timesteps),
                "algo": sb3_name(model),
            }
        ),
        flush=True,
    )


def run_sb3(workload: str, steps: int, inline: bool, timeout: float) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--sb3-child",
        workload,
        "--steps",
        str(steps),
        *(["--inline"] if inline else []),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(bl.ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    whole = time.time() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT ") :]), "whole_s": whole}
    return {
        "error": f"exit code {proc.returncode}: " + " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--workloads",
        default="cartpole,cartpole-inline",
        help="comma-separated NAME[-inline][=STEPS] (default steps: cartpole 100k, crafter 50k)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--quick", action="store_true", help="cartpole, 10k steps")
    parser.add_argument("--sb3-child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--inline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sb3_child:
        sb3_child(args.sb3_child, args.steps, args.inline)
        return
    if args.quick:
        args.workloads = "cartpole=10000"
    if not (SB3_SITE / "stable_baselines3").exists():
        raise SystemExit(
            "SB3 is not installed in .venv-bench/site: run `python benchmarks/run_all.py --sb3 --only whole` once"
        )
    results = {}
    for token in [w for w in args.workloads.split(",") if w]:
        key, _, steps = token.partition("=")
        workload, inline = key.removesuffix("-inline"), key.endswith("-inline")
        steps = int(steps or DEFAULT_STEPS[workload])
        load = os.getloadavg()[0]
        like_sb3 = ["policy_config={name: cnn}"] if workload == "crafter" else []  # SB3's CnnPolicy network
        mine = bench_startup.run_cli(
            workload, bench_startup.iterations_for(workload, steps), inline=inline, extra=like_sb3, timeout=args.timeout
        )
        sb3 = run_sb3(workload, steps, inline, args.timeout)
        row = {
            "steps": steps,
            "mineonline": mine,
            "sb3": sb3,
            "load_1m_before": round(load, 2),
            "load_1m_after": round(os.getloadavg()[0], 2),
        }
        if "whole_s" in mine and "whole_s" in sb3:
            row["whole_ratio_vs_sb3"] = mine["whole_s"] / sb3["whole_s"]
            print(
                f"# {key} {steps} steps: mineonline {mine['whole_s']:.1f} s whole "
                f"(first step {mine['first_env_step_s']:.1f} s, shutdown {mine['shutdown_s']:.1f} s); "
                f"SB3 {sb3['whole_s']:.1f} s whole ({sb3['setup_s']:.1f} set-up + "
                f"{sb3['learn_s']:.1f} learn); ratio {row['whole_ratio_vs_sb3']:.2f}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"# {key}: {json.dumps(row)}", file=sys.stderr, flush=True)
        results[key] = row
    bl.emit("whole", {"results": results}, targets={"cartpole": 1.0, "crafter": 0.67}, quick=args.quick)


if __name__ == "__main__":
    main()
