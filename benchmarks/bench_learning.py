"""Learning benchmark: the full loop (``mineonline_core.driver.api.run``) on CartPole-v1 or Crafter.

CartPole: for each seed, the env steps needed until the 20-episode mean return reaches 475, within
a 150k env-step budget, and the wall time. Crafter: after ``--steps`` env steps, the mean episode
reward of the last window (against a random policy measured the same way) and two Crafter scores:
the last window's, and the paper's (Hafner 2021): the success rate of each achievement over ALL
training episodes that ended within the budget, ``S = exp(mean_a ln(1 + s_a)) - 1`` with ``s_a`` in
percent, computed per seed and then averaged over seeds (mean +- std), as the Crafter analysis code
and its leaderboard do. The per-achievement success table goes to stderr; stdout carries ONE JSON line.

    python benchmarks/bench_learning.py --seeds 0 1 2
    python benchmarks/bench_learning.py --env crafter --steps 1000000 --seeds 0 1 2
    python benchmarks/bench_learning.py --quick      # seed 0, 20k steps: a smoke run of the harness
    python benchmarks/bench_learning.py --env crafter --steps 1000000 --seeds 0 --memory 10
                                                     # also samples every process's RSS every 10 s
    python benchmarks/bench_learning.py --env crafter --config examples/crafter_ppo_resnet.py --steps 1000000 \\
        --seeds 0 --minutes 6 train_config.num_gpus_per_worker=0.5 rollout_config.num_rollout_workers=4 \\
        rollout_config.num_gpus_per_worker=0.1       # stops at 6 minutes (a GPU lease) and scores the steps reached

The all-episode rates come from the run's ``crafter/all_episodes/*`` metrics (``rollout/stats.py``),
logged every 10 episodes: the last record at or before the budget stands for the budget, missing at
most the few episodes that ended since it.

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

from mineonline_core.services.names import LOGGER_HUB, NAMESPACE, ROLLOUT_MANAGER, actor_name  # noqa: E402


def _monitor(
    run_name: str,
    *,
    target: float | None,
    budget: int,
    min_episodes: int,
    done: threading.Event,
    seen: dict,
    memory_interval: float | None = None,
    deadline: float | None = None,
) -> None:
    """Poll the run's hub; ask the manager to stop once the target is reached, the budget spent or the
    ``deadline`` (``time.monotonic()``) passed. With ``memory_interval``, also sample every process's RSS
    into ``seen["memory"]``."""
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
        reached = (
            target is not None and ret is not None and ret >= target and latest.get("episode/count", 0) >= min_episodes
        )
        out_of_time = deadline is not None and time.monotonic() >= deadline
        if reached or steps >= budget or out_of_time:
            seen["stopped_at"], seen["out_of_time"] = steps, out_of_time and steps < budget
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


def run_one(
    source: str,
    seed: int,
    out: str,
    *,
    target: float | None,
    budget: int,
    overrides: list[str],
    memory_interval: float | None = None,
    minutes: float | None = None,
) -> dict:
    from mineonline_core.driver.api import run

    run_name = f"bench-{Path(source).stem}-seed{seed}-{os.getpid()}"
    done, seen = threading.Event(), {}
    deadline = time.monotonic() + 60 * minutes if minutes else None
    thread = threading.Thread(
        target=_monitor,
        args=(run_name,),
        daemon=True,
        kwargs=dict(
            target=target,
            budget=budget,
            min_episodes=20,
            done=done,
            seen=seen,
            memory_interval=memory_interval,
            deadline=deadline,
        ),
    )
    thread.start()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the one JSON line
            result = run(
                source, [f"seed={seed}", f"run_name={run_name}", f"output_dir={out}", *overrides], progress=False
            )
    finally:
        done.set()
    wall = time.perf_counter() - start
    run_dir = Path(result["run_dir"])
    summary = result.get("summary", {})
    row = {
        "seed": seed,
        "wall_s": round(wall, 1),
        "env_steps": int(summary.get("env_steps", seen.get("stopped_at", 0))),
        "iterations": _last_metric(run_dir, "trainer/iteration"),
        "final_return_mean": _last_metric(run_dir, "episode/return_mean"),
        "out_of_time": bool(seen.get("out_of_time")),
    }
    # The whole run's rate (start-up included) is what the user waits for; the last reported one is the steady state.
    row["env_steps_per_s"] = round(row["env_steps"] / wall, 1)
    row["env_steps_per_s_last"] = _last_metric(run_dir, "rollout/env_steps_per_s")
    score = _last_metric(run_dir, "crafter/score")
    if score is not None:
        row["final_crafter_score"] = score
        row["paper_crafter"] = paper_crafter_score(run_dir / "metrics.jsonl", budget)
        row["paper_crafter_along_the_way"] = crafter_trajectory(run_dir / "metrics.jsonl", budget)
    if seen.get("memory"):
        from bench_memory import summarise

        row["memory"] = summarise(seen["memory"])
    if target is not None:
        reached = _first_reach(run_dir, target, 20)
        row["steps_to_target"] = reached if reached is not None and reached <= budget else None
    return row


def _read_records(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines()]


def _score_within(records: list[dict], budget: int) -> dict | None:
    from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS, crafter_score

    record = None
    for candidate in records:
        if "crafter/all_episodes/count" in candidate and candidate["step"] <= budget:
            record = candidate
    if record is None:
        return None
    success = {name: float(record[f"crafter/all_episodes/success/{name}"]) for name in CRAFTER_ACHIEVEMENTS}
    return {
        "score": crafter_score(100.0 * rate for rate in success.values()),
        "episodes": int(record["crafter/all_episodes/count"]),
        "at_env_step": int(record["step"]),
        "success": success,
    }


def paper_crafter_score(metrics_path: Path, budget: int) -> dict | None:
    """The Crafter score by the paper's rule from a run's ``metrics.jsonl``: the success rates over every
    episode logged at or before ``budget`` env steps (the last such ``crafter/all_episodes/*`` record);
    None when the run logged no Crafter episode by then."""
    return _score_within(_read_records(metrics_path), budget)


def crafter_trajectory(metrics_path: Path, budget: int, every: int = 100_000) -> dict[str, float]:
    """The paper's score over all episodes up to each multiple of ``every`` env steps within ``budget`` and
    the run's last step (how fast a run gets there: the paper's rule weighs early episodes as much as late ones)."""
    records = _read_records(metrics_path)  # once: a 1M-step run's file is ~3 MB
    reached = max((r["step"] for r in records), default=0)
    scores = {f"{b // 1000}k": _score_within(records, b) for b in range(every, min(budget, reached) + 1, every)}
    return {k: round(v["score"], 3) for k, v in scores.items() if v is not None}


def mean_std(values: list[float]) -> dict[str, float]:
    """Mean and population standard deviation over seeds (the Crafter analysis code's ``nanstd``)."""
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "n": len(values)}


def success_table(rows: list[dict]) -> str:
    """Per-achievement success rates (%) over all training episodes, one column per seed, most often unlocked first."""
    scored = [r for r in rows if r.get("paper_crafter")]
    if not scored:
        return "no Crafter episode was logged within the budget"
    names = sorted(
        scored[0]["paper_crafter"]["success"], key=lambda n: -sum(r["paper_crafter"]["success"][n] for r in scored)
    )
    lines = [f"{'achievement':<22}" + "".join(f"{'seed ' + str(r['seed']):>10}" for r in scored)]
    for name in names:
        lines.append(f"{name:<22}" + "".join(f"{100 * r['paper_crafter']['success'][name]:>9.1f}%" for r in scored))
    lines.append(f"{'score (all episodes)':<22}" + "".join(f"{r['paper_crafter']['score']:>9.2f}%" for r in scored))
    lines.append(
        f"{'score (last window)':<22}" + "".join(f"{r.get('final_crafter_score', float('nan')):>9.2f}%" for r in scored)
    )
    lines.append(f"{'episodes':<22}" + "".join(f"{r['paper_crafter']['episodes']:>10}" for r in scored))
    return "\n".join(lines)


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
    parser.add_argument(
        "--seeds", nargs="+", default=["0", "1", "2"], metavar="SEED", help="seeds to run, one run each"
    )
    parser.add_argument("--steps", type=int, default=None, help="env-step budget (150k CartPole, 200k Crafter)")
    parser.add_argument(
        "--config", default=None, help="config file (default: examples/cartpole.yaml or examples/crafter.py)"
    )
    parser.add_argument("--quick", action="store_true", help="seed 0 and a 20k-step budget")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock cap per seed: stop there and score the steps reached (a lease's limit)",
    )
    parser.add_argument(
        "--memory", type=float, default=None, metavar="SECONDS", help="sample every process's RSS this often"
    )
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides")
    args = parser.parse_args()
    # `--seeds 0 1 2 train_config.x=1`: the list swallows the overrides that follow it; hand them back.
    args.overrides = [a for a in args.seeds if "=" in a] + args.overrides
    args.seeds = [a for a in args.seeds if "=" not in a]
    if not args.seeds or not all(a.lstrip("-").isdigit() for a in args.seeds):
        parser.error(f"--seeds takes integers, e.g. --seeds 0 1 2; got {args.seeds}")
    args.seeds = [int(a) for a in args.seeds]
    if args.quick:
        args.seeds, args.steps = [0], args.steps or 20_000
    os.environ.setdefault("WANDB_MODE", "disabled")
    import ray

    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    cartpole = args.env == "cartpole"
    budget = args.steps or (150_000 if cartpole else 200_000)
    source = args.config or str(ROOT / "examples" / ("cartpole.yaml" if cartpole else "crafter.py"))
    out = tempfile.mkdtemp(prefix="bench_learning_")
    rows = [
        run_one(
            source,
            seed,
            out,
            target=475.0 if cartpole else None,
            budget=budget,
            overrides=args.overrides,
            memory_interval=args.memory,
            minutes=args.minutes,
        )
        for seed in args.seeds
    ]
    ray.shutdown()
    report: dict = {
        "env": args.env,
        "budget_env_steps": budget,
        "seeds": rows,
        "config": source,
        "overrides": args.overrides,
        "quick": args.quick,
    }
    if cartpole:
        steps = [r["steps_to_target"] for r in rows]
        report["solved"] = f"{sum(s is not None for s in steps)}/{len(steps)}"
        report["steps_to_475_mean"] = statistics.mean(steps) if all(s is not None for s in steps) else None
    else:
        report["final_return_mean"] = statistics.mean(r["final_return_mean"] or 0.0 for r in rows)
        report["random_policy_return_mean"] = random_crafter_reward(20)
        windows = [r["final_crafter_score"] for r in rows if r.get("final_crafter_score") is not None]
        papers = [r["paper_crafter"]["score"] for r in rows if r.get("paper_crafter")]
        report["crafter_score_last_window"] = mean_std(windows) if windows else None
        report["crafter_score_all_episodes"] = mean_std(papers) if papers else None
        print(success_table(rows), file=sys.stderr)
        if papers:
            paper, window = report["crafter_score_all_episodes"], report["crafter_score_last_window"]
            print(
                f"Crafter score over all training episodes (paper's rule): {paper['mean']:.2f} +- {paper['std']:.2f}% "
                f"over {paper['n']} seed(s); last window: {window['mean']:.2f} +- {window['std']:.2f}%",
                file=sys.stderr,
            )
    report["wall_s_mean"] = statistics.mean(r["wall_s"] for r in rows)
    from _benchlib import emit

    emit("learning", report)


if __name__ == "__main__":
    main()
