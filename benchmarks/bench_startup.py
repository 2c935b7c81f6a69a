"""Start-up and shutdown of ``mineonline run`` as a user feels them: the whole command in a subprocess.

Figures (seconds from the moment the command is started):

* ``first_env_step_s``: the first ``step()`` of any rollout env (stamped by the env itself, in its
  process); ``probe_env_step_s``: the step of the driver's pre-Ray env probe;
* ``first_iteration_s``: the first finished training iteration (its metrics record in ``metrics.jsonl``);
* ``last_iteration_s``: the last one;
* ``final_checkpoint_s``: the final checkpoint's ``manifest.json`` written;
* ``shutdown_s``: from the final checkpoint to the command's exit (actors stopped, report written,
  Ray stopped);
* ``whole_s``: the whole command; ``console_lines``: what it printed (``--no-progress``).

Targets (issue 16, quiet machine): first env step <= 10 s, first iteration <= 15 s, shutdown <= 5 s.
The workload is ``_benchlib.PPO_SETTINGS`` (CartPole: CleanRL's 8 envs x 128 steps, 4 epochs, 4
minibatches) through a Python config module whose env stamps its first step; everything else is the
stock command. ``--repeats`` runs it several times (the first pays cold file caches).

    python benchmarks/bench_startup.py                      # CartPole, 5 iterations, 3 repeats
    python benchmarks/bench_startup.py --workload crafter --iterations 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _benchlib as bl  # noqa: E402

# The env of the workload, wrapped to stamp the wall time of the first step of any env of the run.
CONFIG_MODULE = '''
import os
import time

import gymnasium as gym

from mineonline_core.contracts.envs import adapt_env
from mineonline_core.builtin.envs import CrafterEnv, GymnasiumEnv
from mineonline_core.contracts.envs import env_generator_from_config

STAMP = {stamp!r}
WORKLOAD = {workload!r}


class FirstStepStamp(gym.Wrapper):
    """Stamps each process's first step as STAMP.<parent pid>.<grandparent pid>.<parent is a raylet>:
    the benchmark tells the driver's pre-Ray env probe from the rollout's envs."""

    stamped = False

    def step(self, action):
        if not FirstStepStamp.stamped:
            FirstStepStamp.stamped = True
            with open(f"/proc/{{os.getppid()}}/stat") as f:
                parent_name, rest = f.read().split("(", 1)[1].rsplit(")", 1)
            with open(f"{{STAMP}}.{{os.getppid()}}.{{rest.split()[1]}}.{{parent_name == 'raylet'}}", "w") as f:
                f.write(repr(time.time()))
        return self.env.step(action)


def env_generator():
    if WORKLOAD == "crafter":
        make = env_generator_from_config(CrafterEnv, CrafterEnv.Config())
    else:
        make = env_generator_from_config(GymnasiumEnv, GymnasiumEnv.Config(id="CartPole-v1"))
    return FirstStepStamp(adapt_env(make()))


online_dict = {{}}
'''


def iterations_for(workload: str, steps: int) -> int:
    s = bl.ppo_settings(workload)
    per_iteration = s["batch_size_per_gpu"] * s["batches_per_iteration"] * s["fragment_length"]
    return -(-steps // per_iteration)


def run_cli(
    workload: str, iterations: int, *, inline: bool = False, extra: list[str] = (), timeout: float = 1800
) -> dict:
    """Run ``mineonline run`` once in a subprocess; return its timings (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        stamp = Path(tmp) / "first_step"
        config = Path(tmp) / "bench_config.py"
        config.write_text(CONFIG_MODULE.format(stamp=str(stamp), workload=workload))
        name = f"startup-{workload}"
        overrides = [
            o
            for o in bl.online_overrides(workload, iterations=iterations, run_name=name, output_dir=tmp, inline=inline)
            if not o.startswith("env_config=")
        ]
        cmd = [sys.executable, "-m", "mineonline_core.cli", "run", str(config), *overrides, *extra, "--no-progress"]
        env = {**os.environ, "WANDB_MODE": "disabled"}
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=bl.ROOT)
        stdout, stderr = proc.communicate(timeout=timeout)
        end = time.time()
        console = (stdout + stderr).strip().splitlines()
        stamps = {tuple(path.name.split(".")[1:]): float(path.read_text()) for path in Path(tmp).glob("first_step.*")}
        # The probe runs in a child of the driver's forkserver; an inline env steps in a rollout worker,
        # a child of the raylet, which is also the driver's child on a local cluster.
        is_probe = {key: str(proc.pid) in key[:2] and key[2] == "False" for key in stamps}
        probe = [t for key, t in stamps.items() if is_probe[key]]
        rollout = [t for key, t in stamps.items() if not is_probe[key]]
        if proc.returncode != 0:
            return {"error": f"exit code {proc.returncode}: " + " | ".join(console[-6:])}
        run_dir = Path(tmp) / name
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        iters = [r["time"] for r in records if "trainer/iteration" in r]
        manifests = sorted(run_dir.glob("checkpoints/*/manifest.json"))
        final_ckpt = manifests[-1].stat().st_mtime
        out = {
            "probe_env_step_s": min(probe) - start if probe else None,
            "first_env_step_s": min(rollout) - start,
            "first_iteration_s": iters[0] - start,
            "last_iteration_s": iters[-1] - start,
            "final_checkpoint_s": final_ckpt - start,
            "shutdown_s": end - final_ckpt,
            "whole_s": end - start,
            "iterations": len(iters),
            "env_steps": max(r["step"] for r in records),
            "console_lines": len(console),
            "noise_lines": sum(1 for line in console if "pid=" in line or "core_worker" in line or "Traceback" in line),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="cartpole", choices=bl.WORKLOADS)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--inline", action="store_true", help="envs stepped in the rollout worker (env_processes: false)"
    )
    parser.add_argument("--quick", action="store_true", help="one CartPole run of 2 iterations")
    parser.add_argument("overrides", nargs="*", help="extra dotlist overrides, e.g. train_config.use_ray_train=true")
    args = parser.parse_args()
    if args.quick:
        args.workload, args.iterations, args.repeats = "cartpole", 2, 1
    runs = []
    for i in range(args.repeats):
        load = os.getloadavg()[0]
        out = run_cli(args.workload, args.iterations, inline=args.inline, extra=args.overrides)
        out["load_1m_before"] = round(load, 2)
        runs.append(out)
        print(f"# run {i + 1}: {json.dumps(bl._plain(out))}", file=sys.stderr, flush=True)
    good = [r for r in runs if "error" not in r]
    keys = ("first_env_step_s", "first_iteration_s", "shutdown_s", "whole_s")
    median = {k: statistics.median(r[k] for r in good) for k in keys} if good else {}
    targets = {"first_env_step_s": 10.0, "first_iteration_s": 15.0, "shutdown_s": 5.0}
    for key in keys:
        if key in median:
            target = f"  (target <= {targets[key]:g} s)" if key in targets else ""
            print(f"{key:>20}: {median[key]:6.2f} s median of {len(good)}{target}", file=sys.stderr)
    bl.emit(
        "startup",
        {"median": median, "runs": runs},
        workload=args.workload,
        iterations=args.iterations,
        inline=args.inline,
        overrides=args.overrides,
        targets=targets,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
