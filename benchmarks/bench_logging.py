"""What logging every iteration costs, relative to end-to-end throughput.

Every training iteration the trainer sends ``--metrics`` scalars and three histograms of
``--hist-size`` values to the run's ``LoggerHub`` actor, fire-and-forget, either as separate calls
(``log_metrics`` + three ``log_histogram``: pattern ``calls``) or as one ``log_batch`` (``batch``).
The benchmark measures, against a real hub actor with the console logger and with console + wandb
(offline), the CPU that one logged iteration costs:

* in the training process (the calls themselves and Ray's serialisation threads), and
* in the hub process and its children (the loggers, wandb's service process),

by running paced loops that log every "iteration" and, as the baseline, the same loops logging
nothing (``idle``), rotated over rounds. Each loop ends only when the hub has fed every item to
every logger (``hub.flush``), so no logging work hides after the clock stops. CPU time, not wall
time, is compared: on a shared machine wall-clock differences of a few percent are unmeasurable,
while the CPU a fixed amount of logging needs is stable.

``overhead_pct_*`` = that CPU / the CPU of one training iteration (``--iteration-ms``, default
250 ms, short for a PPO iteration: real ones are seconds), an upper bound on the throughput lost when
every core is busy; ``min_iteration_ms_for_2pct_*`` is the shortest iteration for which logging stays
under the 2 % target. ``--end-to-end`` adds a direct A/B of a calibrated synthetic training loop
with and without logging (wall clock; informative on a quiet machine only).

    PYTHONPATH=. python benchmarks/bench_logging.py [--quick] [--end-to-end]

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _benchlib as bl  # noqa: E402  (the shared one-JSON-line output)

ROOT = Path(__file__).resolve().parents[1]
WANDB_PLUGIN = ROOT / "plugins" / "wandb_logger"
PATTERNS = ("idle", "calls", "batch")  # no logging; log_metrics + 3 log_histogram; one log_batch
HISTOGRAMS = ("trainer/advantages", "trainer/values", "trainer/staleness")


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


class Payload:
    """One iteration's worth of logging, sent one of the ``PATTERNS`` ways."""

    def __init__(self, metrics: int, hist_size: int) -> None:
        rng = np.random.default_rng(0)
        self.names = [f"trainer/metric_{i:02d}" for i in range(metrics)]
        self.hists = dict(zip(HISTOGRAMS, (rng.standard_normal(hist_size).astype(np.float32) for _ in HISTOGRAMS)))

    def send(self, hub, pattern: str, it: int) -> None:
        scalars = {name: float(it + i) for i, name in enumerate(self.names)}
        if pattern == "calls":
            hub.log_metrics.remote(scalars)
            for key, values in self.hists.items():
                hub.log_histogram.remote(key, values)
        elif pattern == "batch":
            hub.log_batch.remote(scalars, self.hists)


def measure(hub, payload: Payload, *, pattern: str, iterations: int, step) -> dict[str, float]:
    """CPU of this process and of the hub's process tree, wall time, over one loop."""
    import ray

    hub_pid = ray.get(hub.__ray_call__.remote(lambda self: os.getpid()))
    hub0, cpu0, t0 = tree_cpu_seconds(hub_pid), time.process_time(), time.perf_counter()
    for it in range(iterations):
        step()
        payload.send(hub, pattern, it)
    ray.get(hub.flush.remote(600))  # every item reached every logger: no work hides after the clock
    return {
        "cpu": time.process_time() - cpu0,
        "hub_cpu": tree_cpu_seconds(hub_pid) - hub0,
        "wall": time.perf_counter() - t0,
    }


def start_hub(run_dir: str, with_wandb: bool, iterations: int):
    from mineonline_core.builtin.console import ConsoleLogger, ConsoleOptions
    from mineonline_core.services.loggerhub import start_logger_hub

    loggers = [(ConsoleLogger, ConsoleOptions())]
    if with_wandb:
        from mineonline_wandb import WandbLogger, WandbOptions

        loggers.append((WandbLogger, WandbOptions(project="bench-logging")))
    name = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    return start_logger_hub(
        run_name=name,
        run_dir=run_dir,
        loggers=loggers,
        config={"bench": True},
        num_iterations=iterations,
        video_dir="videos",
    )


def synthetic_iteration(target_ms: float):
    """A single-threaded matmul loop taking about ``target_ms`` of CPU (for ``--end-to-end``)."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    t0 = time.process_time()  # CPU time: on a loaded machine wall time would undersize it
    for _ in range(200):
        torch.tanh(a @ a)
    reps = max(1, int(target_ms / 1000 / ((time.process_time() - t0) / 200)))

    def step() -> None:
        b = a
        for _ in range(reps):
            b = torch.tanh(a @ b)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and rounds (about a minute)")
    parser.add_argument("--iterations", type=int, default=None, help="logged iterations per loop")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--pace-ms", type=float, default=10.0, help="pause between logged iterations in the cost loops")
    parser.add_argument("--iteration-ms", type=float, default=250.0, help="CPU time of one training iteration")
    parser.add_argument("--metrics", type=int, default=60)
    parser.add_argument("--hist-size", type=int, default=4096)
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--end-to-end", action="store_true", help="also A/B a synthetic training loop (slow)")
    args = parser.parse_args()
    # Sized for run_all.py's budget (120 s full) on a loaded 2-core machine.
    iterations = args.iterations or (60 if args.quick else 120)
    rounds = args.rounds or (2 if args.quick else 3)

    tmp = tempfile.mkdtemp(prefix="bench-logging-")
    os.environ["WANDB_MODE"] = "offline"  # what is measured: wandb writing its offline run (no network)
    os.environ.setdefault("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ.setdefault(var, os.path.join(tmp, var.lower()))
    try:
        import mineonline_wandb  # noqa: F401
    except ImportError:  # not pip-installed: let this process and the Ray workers find the source
        sys.path.insert(0, str(WANDB_PLUGIN))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(WANDB_PLUGIN), str(ROOT), os.environ.get("PYTHONPATH")])
        )

    import ray

    ray.init(num_cpus=2, address="local", include_dashboard=False, namespace="mineonline", log_to_driver=False)
    try:
        payload = Payload(args.metrics, args.hist_size)
        modes = ["console"] + ([] if args.no_wandb else ["console_wandb"])
        result: dict[str, object] = {
            "iterations": iterations,
            "rounds": rounds,
            "metrics_per_iteration": args.metrics,
            "histograms_per_iteration": len(HISTOGRAMS),
            "histogram_size": args.hist_size,
            "iteration_ms": args.iteration_ms,
            "target_overhead_pct": 2.0,
        }

        def pace() -> None:
            time.sleep(args.pace_ms / 1000)

        passed = {pattern: True for pattern in PATTERNS[1:]}
        for mode in modes:
            runs: dict[str, list[dict[str, float]]] = {p: [] for p in PATTERNS}
            finish: list[float] = []
            for r in range(rounds):
                hub = start_hub(os.path.join(tmp, f"{mode}-{r}"), mode.endswith("wandb"), iterations)
                for pattern in PATTERNS[r % 3 :] + PATTERNS[: r % 3]:  # rotate: no order favoured
                    runs[pattern].append(measure(hub, payload, pattern=pattern, iterations=iterations, step=pace))
                f0 = time.perf_counter()
                ray.get(hub.finish.remote())
                finish.append(time.perf_counter() - f0)
                ray.kill(hub)

            def med(pattern: str, field: str) -> float:
                return statistics.median(run[field] for run in runs[pattern])

            result[f"finish_s_{mode}"] = round(statistics.median(finish), 3)
            result[f"hub_idle_cpu_pct_of_a_core_{mode}"] = round(100 * med("idle", "hub_cpu") / med("idle", "wall"), 3)
            for pattern in PATTERNS[1:]:
                key = f"{mode}_{pattern}"
                driver_ms = 1000 * (med(pattern, "cpu") - med("idle", "cpu")) / iterations
                hub_ms = 1000 * (med(pattern, "hub_cpu") - med("idle", "hub_cpu")) / iterations
                cost_ms = max(driver_ms, 0.0) + max(hub_ms, 0.0)
                result[f"driver_cpu_ms_per_iteration_{key}"] = round(driver_ms, 3)
                result[f"hub_cpu_ms_per_iteration_{key}"] = round(hub_ms, 3)
                result[f"overhead_pct_{key}"] = round(100 * cost_ms / args.iteration_ms, 3)
                result[f"min_iteration_ms_for_2pct_{key}"] = round(cost_ms / 0.02, 1)
                passed[pattern] &= cost_ms / args.iteration_ms < 0.02

        if args.end_to_end:
            step = synthetic_iteration(args.iteration_ms)
            e2e_iterations = max(10, iterations // 10)
            walls: dict[str, list[float]] = {"none": [], "console_wandb_batch": []}
            for r in range(rounds):
                hub = start_hub(os.path.join(tmp, f"e2e-{r}"), not args.no_wandb, e2e_iterations)
                walls["none"].append(
                    measure(hub, payload, pattern="idle", iterations=e2e_iterations, step=step)["wall"]
                )
                walls["console_wandb_batch"].append(
                    measure(hub, payload, pattern="batch", iterations=e2e_iterations, step=step)["wall"]
                )
                ray.get(hub.finish.remote())
                ray.kill(hub)
            result["end_to_end_wall_overhead_pct"] = round(
                100 * (min(walls["console_wandb_batch"]) / min(walls["none"]) - 1), 3
            )

        # Per pattern: "batch" (log_batch, one actor task per iteration) is the recommended way.
        result.update({f"pass_{pattern}": ok for pattern, ok in passed.items()})
        result["pass"] = all(passed.values())
        bl.emit("logging", result, quick=args.quick)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
