"""Learning benchmark: the full loop (``mineonline_core.runtime.api.run``) on CartPole-v1 or Crafter.

CartPole: for each seed, the env steps needed until the 20-episode mean return reaches 475, within
a 150k env-step budget, and the wall time. Crafter: the mean episode reward of the last window after
``--steps`` env steps, against a random policy measured the same way. Prints ONE JSON line.

    python benchmarks/bench_learning.py --seeds 3
    python benchmarks/bench_learning.py --env crafter --steps 200000 --seeds 1
    python benchmarks/bench_learning.py --quick      # one seed, 20k steps: a smoke run of the harness
    python benchmarks/bench_learning.py --env crafter --steps 1000000 --seeds 1 --memory 10
                                                     # also samples every process's RSS every 10 s

With ``--memory`` the long learning run doubles as issue 8's flat-memory check: the JSON line gains
``bench_memory``'s figures (peak RSS and the growth over the second half of the run, per role).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from mineonline_core.runtime.names import LOGGER_HUB, NAMESPACE, ROLLOUT_MANAGER, actor_name  # noqa: E402


def _monitor(run_name: str, *, target: float | None, budget: int, min_episodes: int, done: threading.Event, seen: dict,
             memory_interval: float | None = None) -> None:
    """Poll the run's hub; ask the manager to stop once the target is reached or the budget spent.
    With ``memory_interval``, also sample every process's RSS into ``seen["memory"]``."""
    import ray
    from bench_memory import sample

    next_sample, start = 0.0, time.monotonic()

    hub = manager = None
    while not done.is_set() and (hub is None or manager is None):
        try:
            hub = ray.get_actor(actor_name(run_name, LOGGER_HUB), namespace=NAMESPACE)
            manager = ray.get_actor(actor_name(run_name, ROLLOUT_MANAGER), namespace=NAMESPACE)
        except ValueError:
            done.wait(1.0)
    while not done.wait(1.0):
        try:
            latest = ray.get(hub.latest.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the run is ending
            return
        steps, ret = latest.get("env_steps", 0.0), latest.get("episode/return_mean")
        seen["last"] = latest
        if memory_interval and time.monotonic() >= next_sample:
            next_sample = time.monotonic() + memory_interval
            seen.setdefault("memory", []).append((time.monotonic() - start, sample()))
        reached = target is not None and ret is not None and ret >= target and latest.get("episode/count", 0) >= min_episodes
        if reached or steps >= budget:
            seen["stopped_at"] = steps
            manager.request_stop.remote()
            return


def _first_reach(run_dir: Path, target: float, min_episodes: int) -> int | None:
    """The env step of the first logged window mean >= target (from the run's metrics.jsonl)."""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        ret, count = record.get("episode/return_mean"), record.get("episode/count", 0)
        if ret is not None and ret >= target and count >= min_episodes:
            return int(record["step"])
    return None


def _last_metric(run_dir: Path, key: str) -> float | None:
    value = None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        value = json.loads(line).get(key, value)
    return value


def run_one(source: str, seed: int, out: str, *, target: float | None, budget: int, overrides: list[str],
            memory_interval: float | None = None) -> dict:
    from mineonline_core.runtime.api import run

    run_name = f"bench-{Path(source).stem}-seed{seed}-{os.getpid()}"
    done, seen = threading.Event(), {}
    thread = threading.Thread(target=_monitor, args=(run_name,), daemon=True,
                              kwargs=dict(target=target, budget=budget, min_episodes=20, done=done, seen=seen,
                                          memory_interval=memory_interval))  # fmt: skip
    thread.start()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the one JSON line
            result = run(source, [f"seed={seed}", f"run_name={run_name}", f"output_dir={out}", *overrides], progress=False)
    finally:
        done.set()
    wall = time.perf_counter() - start
    run_dir = Path(result["run_dir"])
    summary = result.get("summary", {})
    row = {"seed": seed, "wall_s": round(wall, 1), "env_steps": int(summary.get("env_steps", seen.get("stopped_at", 0))),
           "iterations": _last_metric(run_dir, "trainer/iteration"), "final_return_mean": _last_metric(run_dir, "episode/return_mean")}  # fmt: skip
    score = _last_metric(run_dir, "crafter/score")
    if score is not None:
        row["final_crafter_score"] = score
    if seen.get("memory"):
        from bench_memory import summarise

        row["memory"] = summarise(seen["memory"])
    if target is not None:
        reached = _first_reach(run_dir, target, 20)
        row["steps_to_target"] = reached if reached is not None and reached <= budget else None
    return row


def random_crafter_reward(episodes: int, seed: int = 0) -> float:
    import crafter
    import numpy as np

    env, rng, totals = crafter.Env(seed=seed), np.random.default_rng(seed), []
    for _ in range(episodes):
        env.reset()
        done, total = False, 0.0
        while not done:
            _, reward, done, _ = env.step(int(rng.integers(env.action_space.n)))
            total += reward
        totals.append(total)
    return float(np.mean(totals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["cartpole", "crafter"], default="cartpole")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="env-step budget (150k CartPole, 200k Crafter)")
    parser.add_argument("--config", default=None, help="config file (default: examples/cartpole.yaml or examples/crafter.py)")
    parser.add_argument("--quick", action="store_true", help="one seed and a 20k-step budget")
    parser.add_argument("--memory", type=float, default=None, metavar="SECONDS", help="sample every process's RSS this often")
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps = 1, args.steps or 20_000
    os.environ.setdefault("WANDB_MODE", "disabled")
    import ray

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})  # fmt: skip
    cartpole = args.env == "cartpole"
    budget = args.steps or (150_000 if cartpole else 200_000)
    source = args.config or str(ROOT / "examples" / ("cartpole.yaml" if cartpole else "crafter.py"))
    out = tempfile.mkdtemp(prefix="bench_learning_")
    rows = [run_one(source, seed, out, target=475.0 if cartpole else None, budget=budget, overrides=args.overrides,
                   memory_interval=args.memory)
            for seed in range(args.seeds)]  # fmt: skip
    ray.shutdown()
    report: dict = {"env": args.env, "budget_env_steps": budget, "seeds": rows, "config": source,
                    "overrides": args.overrides, "quick": args.quick}  # fmt: skip
    if cartpole:
        steps = [r["steps_to_target"] for r in rows]
        report["solved"] = f"{sum(s is not None for s in steps)}/{len(steps)}"
        report["steps_to_475_mean"] = statistics.mean(steps) if all(s is not None for s in steps) else None
    else:
        report["final_return_mean"] = statistics.mean(r["final_return_mean"] or 0.0 for r in rows)
        report["random_policy_return_mean"] = random_crafter_reward(20)
    report["wall_s_mean"] = statistics.mean(r["wall_s"] for r in rows)
    from _benchlib import emit

    emit("learning", report)


if __name__ == "__main__":
    main()
