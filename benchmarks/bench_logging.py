"""What logging every iteration costs, relative to end-to-end throughput.

A fixed synthetic training loop (single-threaded matmuls calibrated to ``--iteration-ms`` of CPU per
iteration) runs N iterations against a real ``LoggerHub`` actor, console only and console + wandb
(offline), three ways each, rotated over several rounds so that machine noise hits each alike:
``idle`` (no logging: the baseline), ``calls`` (every iteration ``log_metrics`` with ``--metrics``
scalars and three ``log_histogram`` of ``--hist-size`` values, fire-and-forget, as the trainer does)
and ``batch`` (the same data in one ``log_batch`` call). Each loop ends only when the hub has fed
every item to every logger (``hub.flush``), so no logging work hides after the clock stops.

Two overhead figures, because a shared machine makes wall-clock differences of a few percent
unmeasurable:

* ``cpu_overhead_pct``: the CPU that logging costs per iteration, as a share of the iteration's own
  CPU time: (extra CPU of the training process with logging, serialisation threads included) + (CPU
  of the hub process and its children, e.g. wandb's service). It is an upper bound on the throughput
  lost when every core is busy, and it is stable under load. This is the figure held to < 2 %.
* ``wall_overhead_pct``: best-of-rounds wall time with logging vs without (noisy under load).

The one-off cost of closing the loggers at the end of a run (``hub.finish``: wandb's final sync)
is reported apart, in seconds.

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
    # CPU time, not wall time: on a loaded machine wall time would undersize the workload.
    t0 = time.process_time()
    for _ in range(200):
        torch.tanh(a @ a)
    per = (time.process_time() - t0) / 200
    return max(1, int(target_ms / 1000 / per)), a


def workload(reps: int, a: torch.Tensor) -> None:
    b = a
    for _ in range(reps):
        b = torch.tanh(a @ b)


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its living descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while scanning
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(times.get(p, 0.0) for p in tree)


PATTERNS = ("idle", "calls", "batch")  # no logging; log_metrics + 3 log_histogram; one log_batch
HISTOGRAMS = ("trainer/advantages", "trainer/values", "trainer/staleness")


def run_loop(hub, *, log: str, iterations: int, reps: int, a: torch.Tensor, metrics: int, hist_size: int) -> dict[str, float]:
    """Wall, driver-CPU, hub-CPU and in-call seconds of one loop, until the hub fed every logger."""
    import ray

    rng = np.random.default_rng(0)
    names = [f"trainer/metric_{i:02d}" for i in range(metrics)]
    hists = [rng.standard_normal(hist_size).astype(np.float32) for _ in range(3)]
    in_calls = 0.0
    hub_pid = ray.get(hub.__ray_call__.remote(lambda self: os.getpid()))
    hub_cpu0 = tree_cpu_seconds(hub_pid)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for it in range(iterations):
        workload(reps, a)
        c0 = time.perf_counter()
        scalars = {name: float(it + i) for i, name in enumerate(names)}
        if log == "calls":  # one task per item: log_metrics + a log_histogram each
            hub.log_metrics.remote(scalars)
            for key, values in zip(HISTOGRAMS, hists):
                hub.log_histogram.remote(key, values)
        elif log == "batch":  # one task per iteration
            hub.log_batch.remote(scalars, dict(zip(HISTOGRAMS, hists)))
        in_calls += time.perf_counter() - c0
    ray.get(hub.flush.remote(600))  # every item reached every logger: no work hidden after the clock
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    hub_cpu = tree_cpu_seconds(hub_pid) - hub_cpu0
    return {"wall": wall, "cpu": cpu, "hub_cpu": hub_cpu, "in_calls": in_calls}


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
    iterations = args.iterations or (20 if args.quick else 40)
    rounds = args.rounds or 3
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
        modes = ["console"] + ([] if args.no_wandb else ["console_wandb"])
        runs: dict[tuple[str, str], list[dict[str, float]]] = {(m, log): [] for m in modes for log in PATTERNS}
        finish: dict[str, list[float]] = {m: [] for m in modes}
        workload(reps, a)  # warm-up
        for r in range(rounds):
            for mode in modes:
                hub = start_hub(os.path.join(tmp, f"{mode}-{r}"), mode.endswith("wandb"), iterations)
                # The same loop with the hub idle and with logging every iteration (two ways);
                # rotate the order by round so warm-up effects do not favour one.
                for log in PATTERNS[r % 3 :] + PATTERNS[: r % 3]:
                    runs[(mode, log)].append(run_loop(hub, log=log, iterations=iterations, reps=reps, a=a, metrics=args.metrics, hist_size=args.hist_size))
                f0 = time.perf_counter()
                ray.get(hub.finish.remote())
                finish[mode].append(time.perf_counter() - f0)
                ray.kill(hub)

        def med(mode: str, log: str, field: str) -> float:
            return statistics.median(run[field] for run in runs[(mode, log)])

        result = {
            "benchmark": "logging",
            "iterations": iterations,
            "rounds": rounds,
            "metrics_per_iteration": args.metrics,
            "histograms_per_iteration": 3,
            "histogram_size": args.hist_size,
            "iteration_cpu_ms_no_logging": round(1000 * med("console", "idle", "cpu") / iterations, 2),
            "iteration_wall_ms_no_logging": round(1000 * med("console", "idle", "wall") / iterations, 2),
            "load_average_1min": round(os.getloadavg()[0], 2),
            "target_overhead_pct": 2.0,
        }
        for mode in modes:
            base_cpu = med(mode, "idle", "cpu")
            best_idle = min(run["wall"] for run in runs[(mode, "idle")])
            result[f"hub_idle_cpu_pct_of_a_core_{mode}"] = round(100 * med(mode, "idle", "hub_cpu") / med(mode, "idle", "wall"), 3)
            result[f"finish_s_{mode}"] = round(statistics.median(finish[mode]), 3)
            for log in PATTERNS[1:]:
                key = f"{mode}_{log}"
                extra_driver = med(mode, log, "cpu") - base_cpu
                extra_hub = med(mode, log, "hub_cpu") - med(mode, "idle", "hub_cpu")
                result[f"cpu_overhead_pct_{key}"] = round(100 * (max(extra_driver, 0.0) + max(extra_hub, 0.0)) / base_cpu, 3)
                result[f"wall_overhead_pct_{key}"] = round(100 * (min(run["wall"] for run in runs[(mode, log)]) / best_idle - 1), 3)
                result[f"driver_extra_cpu_ms_per_iteration_{key}"] = round(1000 * extra_driver / iterations, 3)
                result[f"hub_extra_cpu_ms_per_iteration_{key}"] = round(1000 * extra_hub / iterations, 3)
                result[f"logging_call_us_per_iteration_{key}"] = round(1e6 * med(mode, log, "in_calls") / iterations, 1)
        result["pass"] = all(result[f"cpu_overhead_pct_{m}_{log}"] < 2.0 for m in modes for log in PATTERNS[1:])
        print(json.dumps(result))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
