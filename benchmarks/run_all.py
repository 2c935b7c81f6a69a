"""Run every benchmark in ``benchmarks/`` in sequence and collect their JSON lines.

Each ``bench_*.py`` prints one JSON line; this script runs them one after
another (never in parallel: they measure throughput), each with a budget chosen so that the whole
set stays under 35 minutes on a 2-core machine, and appends every line to
``benchmarks/out/results.jsonl`` (a failed or timed-out script gets a line with ``error``).
``make bench`` calls it.

    python benchmarks/run_all.py                 # the full set (< 35 min)
    python benchmarks/run_all.py --quick         # every script's --quick smoke run
    python benchmarks/run_all.py --only e2e,broadcast
    python benchmarks/run_all.py --sb3           # first install SB3 into .venv-bench/ (see requirements-bench.txt)

Scripts written by others (``bench_vpt.py``, ``bench_lmdb.py``, ``bench_logging.py``,
``bench_learning.py``, ...) run with the arguments in ``PLAN`` or, when unknown, with none.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
BENCH_SITE = ROOT / ".venv-bench" / "site"

# script -> (arguments of the full run, budget in seconds). Order: cheap first.
PLAN: dict[str, tuple[list[str], int]] = {
    "bench_broadcast.py": (["--params", "1e6,71e6,248e6", "--workers", "1,2,4", "--repeats", "3"], 150),
    "bench_collection.py": (["--workload", "crafter", "--num-envs", "4", "--seconds", "20"], 150),
    "bench_lmdb.py": ([], 120),
    "bench_logging.py": ([], 120),
    # bench_e2e runs the plain loop (plain_ppo.py) itself, beside mineonline and SB3.
    "bench_e2e.py": (["--workloads", "cartpole=40,cartpole-inline=40,crafter=8", "--timeout", "150"], 570),
    "bench_memory.py": (["--minutes", "2"], 240),
    "bench_vpt.py": ([], 150),
    # Issue 19: which Crafter networks a 2-core machine can train for 1M steps (Moon et al.'s ResNet takes ~2 min here).
    "bench_policy_cost.py": (["--repeats", "2"], 300),
    # MineStudio's cow example end to end on the real MinecraftSim (fake engine), small VPT weights.
    "bench_minestudio.py": (["--iterations", "2"], 300),
    # One seed fits the 30-minute set; the 3-seed learning figure is `bench_learning.py --seeds 0 1 2` (~10 min).
    "bench_learning.py": (["--seeds", "0"], 240),
    # Issue 16: the whole command's start-up and shutdown, and its wall clock against SB3 (CartPole 100k).
    "bench_startup.py": (["--repeats", "1"], 150),
    "bench_whole.py": (["--workloads", "cartpole"], 300),
}
# The budgets above sum to 42 minutes; the set took 10.5 minutes (session 2), and a script that would
# push the elapsed time past TOTAL_BUDGET is skipped, so `make bench` stays under 30 minutes.
TOTAL_BUDGET = 29.5 * 60  # a script whose budget would overrun this is skipped (and reported)
QUICK_BUDGET = 240  # per script; a quick run under heavy load can take minutes for Ray to start


def scripts() -> list[str]:
    found = sorted(p.name for p in HERE.glob("bench_*.py"))
    ordered = [s for s in PLAN if s in found]
    return ordered + [s for s in found if s not in ordered]


def run_one(script: str, args: list[str], budget: int) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
    }
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *args],
            capture_output=True,
            text=True,
            timeout=budget,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return [{"bench": script, "error": f"exceeded its budget of {budget}s", "args": args}]
    wall = time.perf_counter() - start
    lines = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    if proc.returncode != 0 or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        lines.append({"bench": script, "error": f"exit code {proc.returncode}: {tail}", "args": args})
    for line in lines:
        line.setdefault("script", script)
        line["script_wall_s"] = round(wall, 1)
    return lines


def install_sb3() -> None:
    """SB3 and sb3-contrib into ``.venv-bench/site`` without dependencies, so torch is never replaced
    (everything they need is already in the project venv); the benchmark puts it on sys.path."""
    req = HERE / "requirements-bench.txt"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(BENCH_SITE), "-r", str(req)], check=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every script's --quick run")
    parser.add_argument("--only", default="", help="comma-separated script names or stems (e2e, bench_e2e.py)")
    parser.add_argument("--sb3", action="store_true", help="install SB3 into .venv-bench/ first")
    parser.add_argument("--out", default=str(OUT / "results.jsonl"))
    args = parser.parse_args()
    if args.sb3 and not (BENCH_SITE / "stable_baselines3").exists():
        install_sb3()
    chosen = scripts()
    if args.only:
        wanted = {
            w if w.endswith(".py") else (w if w.startswith(("bench_", "plain_")) else f"bench_{w}")
            for w in args.only.split(",")
        }
        chosen = [s for s in chosen if s in wanted or s[:-3] in wanted]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    start = time.perf_counter()
    for script in chosen:
        full_args, budget = PLAN.get(script, ([], 120))
        budget = QUICK_BUDGET if args.quick else budget
        if not args.quick and time.perf_counter() - start + budget > TOTAL_BUDGET:
            lines = [
                {
                    "bench": script,
                    "error": f"skipped: the set's {TOTAL_BUDGET / 60:.0f}-minute budget would be exceeded",
                }
            ]
        else:
            lines = run_one(script, ["--quick"] if args.quick else full_args, budget)
        with out.open("a") as f:
            for line in lines:
                f.write(json.dumps({"run_all": stamp, **line}) + "\n")
        status = "error: " + str(lines[-1]["error"])[:200] if lines[-1].get("error") else "ok"
        print(f"{script:24s} {lines[-1].get('script_wall_s', '-'):>7}s  {status}", flush=True)
    print(f"total {time.perf_counter() - start:.0f}s; results appended to {out}")


if __name__ == "__main__":
    main()
