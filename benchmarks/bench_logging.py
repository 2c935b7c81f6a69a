"""What logging every iteration costs, relative to end-to-end throughput.

A fixed synthetic training loop (single-threaded matmuls calibrated to ``--iteration-ms`` per
iteration) runs N iterations three ways, interleaved over several rounds so that machine noise hits
each the same: without logging; logging every iteration through a real ``LoggerHub`` actor with the
console logger; and with console + wandb (offline). Each iteration logs ``--metrics`` scalars, three
histograms of ``--hist-size`` values and an env-step count, fire-and-forget, exactly as the trainer
and the rollout workers do. The overhead is (median time with logging / median time without) - 1,
the loop's clock stops only when the hub has fed every item to every logger (``hub.flush``). The
one-off cost of closing the loggers at the end of a run (``hub.finish``: wandb's final sync) is
reported apart, in seconds. Target: < 2 %.

    PYTHONPATH=. python benchmarks/bench_logging.py [--quick]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
WANDB_PLUGIN = ROOT / "plugins" / "wandb_logger"


def calibrate(target_ms: float) -> tuple[int, torch.Tensor]:
    """Matmuls per iteration so that one iteration takes about ``target_ms``."""
    a = torch.randn(256, 256)
    for _ in range(5):
        a @ a
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    per = (time.perf_counter() - t0) / 50
    return max(1, int(target_ms / 1000 / per)), a


def workload(reps: int, a: torch.Tensor) -> None:
    b = a
    for _ in range(reps):
        b = torch.tanh(a @ b)


def run_loop(hub, *, iterations: int, reps: int, a: torch.Tensor, metrics: int, hist_size: int) -> tuple[float, float]:
    """Seconds for the loop (until the hub has fed every logger) and seconds inside the logging calls."""
    import ray

    rng = np.random.default_rng(0)
    names = [f"trainer/metric_{i:02d}" for i in range(metrics)]
    hists = [rng.standard_normal(hist_size).astype(np.float32) for _ in range(3)]
    in_calls = 0.0
    t0 = time.perf_counter()
    for it in range(iterations):
        workload(reps, a)
        if hub is not None:
            c0 = time.perf_counter()
            hub.add_env_steps.remote(2048)
            hub.log_metrics.remote({name: float(it + i) for i, name in enumerate(names)})
            for key, values in zip(("trainer/advantages", "trainer/values", "trainer/staleness"), hists):
                hub.log_histogram.remote(key, values)
            in_calls += time.perf_counter() - c0
    if hub is not None:
        ray.get(hub.flush.remote(600))  # every item reached every logger: no work hidden after the clock
    return time.perf_counter() - t0, in_calls


def start_hub(run_dir: str, with_wandb: bool, iterations: int):
    from mineonline_core.console import ConsoleLogger, ConsoleOptions
    from mineonline_core.loggerhub import start_logger_hub

    loggers = [(ConsoleLogger, ConsoleOptions())]
    if with_wandb:
        from mineonline_wandb import WandbLogger, WandbOptions

        loggers.append((WandbLogger, WandbOptions(project="bench-logging")))
    name = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    return start_logger_hub(run_name=name, run_dir=run_dir, loggers=loggers, config={"bench": True}, num_iterations=iterations, video_dir="videos")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter iterations (about a minute)")
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iteration-ms", type=float, default=None, help="synthetic iteration time without logging")
    parser.add_argument("--metrics", type=int, default=60)
    parser.add_argument("--hist-size", type=int, default=4096)
    parser.add_argument("--no-wandb", action="store_true")
    args = parser.parse_args()
    iterations = args.iterations or (20 if args.quick else 60)
    rounds = args.rounds or (3 if args.quick else 5)
    iteration_ms = args.iteration_ms or (100.0 if args.quick else 250.0)

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-logging-")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ.setdefault(var, os.path.join(tmp, var.lower()))
    try:
        import mineonline_wandb  # noqa: F401
    except ImportError:  # not pip-installed: let this process and the Ray workers find the source
        sys.path.insert(0, str(WANDB_PLUGIN))
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WANDB_PLUGIN), str(ROOT), os.environ.get("PYTHONPATH")]))

    import ray

    ray.init(num_cpus=2, address="local", include_dashboard=False, namespace="mineonline", log_to_driver=False)
    try:
        reps, a = calibrate(iteration_ms)
        modes = ["none", "console"] + ([] if args.no_wandb else ["console+wandb"])
        totals: dict[str, list[float]] = {m: [] for m in modes}
        calls: dict[str, list[float]] = {m: [] for m in modes}
        finish: dict[str, list[float]] = {m: [] for m in modes}
        workload(reps, a)  # warm-up
        for r in range(rounds):
            for mode in modes:
                hub = None if mode == "none" else start_hub(os.path.join(tmp, f"{mode}-{r}"), mode.endswith("wandb"), iterations)
                seconds, in_calls = run_loop(hub, iterations=iterations, reps=reps, a=a, metrics=args.metrics, hist_size=args.hist_size)
                totals[mode].append(seconds)
                calls[mode].append(in_calls)
                if hub is not None:
                    f0 = time.perf_counter()
                    ray.get(hub.finish.remote())
                    finish[mode].append(time.perf_counter() - f0)
                    ray.kill(hub)
        base = statistics.median(totals["none"])
        result = {
            "benchmark": "logging",
            "iterations": iterations,
            "rounds": rounds,
            "metrics_per_iteration": args.metrics,
            "histograms_per_iteration": 3,
            "histogram_size": args.hist_size,
            "iteration_ms_no_logging": round(1000 * base / iterations, 2),
            "target_overhead_pct": 2.0,
        }
        for mode in modes[1:]:
            key = mode.replace("+", "_")
            med = statistics.median(totals[mode])
            result[f"overhead_pct_{key}"] = round(100 * (med / base - 1), 3)
            result[f"logging_call_us_per_iteration_{key}"] = round(1e6 * statistics.median(calls[mode]) / iterations, 1)
            result[f"iteration_ms_{key}"] = round(1000 * med / iterations, 2)
            result[f"finish_s_{key}"] = round(statistics.median(finish[mode]), 3)
        result["pass"] = all(result[f"overhead_pct_{m.replace('+', '_')}"] < 2.0 for m in modes[1:])
        print(json.dumps(result))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
