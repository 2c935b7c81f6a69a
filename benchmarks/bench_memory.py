"""Memory: peak RSS of every process of a ``mineonline run``, and whether replay memory stays flat.

Starts a Crafter PPO run (``mineonline_core.driver.api.run``, LMDB store) in a thread of this process (so
this process is the driver), samples the RSS of every process of the run every ``--interval``
seconds from ``/proc`` (Ray's worker processes are titled ``ray::<ActorClass>``; the env processes
are their children), and after ``--minutes`` asks the run to stop (``RolloutManager.request_stop``,
as ``mineonline stop`` does). Figures: peak RSS (``VmHWM``) per role, the RSS time series per role,
and the growth rate of each role's RSS over the second half of the run (MiB/min; flat is ~0).

    python benchmarks/bench_memory.py --minutes 2          # the default
    python benchmarks/bench_memory.py --minutes 30         # the long check of issue 8
    python benchmarks/bench_memory.py --minutes 4 --num-envs 4 --vpt 1x   # a VPT-1x-sized policy

``--vpt 1x`` swaps the policy for OpenAI's VPT foundation-model-1x architecture (random weights, a
head for Crafter's actions) and shrinks an iteration to one 64-step chunk, one epoch, so that a CPU
learner finishes iterations within the run. Further OmegaConf overrides may follow the options.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _benchlib as bl  # noqa: E402

from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name  # noqa: E402

# Ray titles each actor process "ray::<Class>" (or "ray::<Class>.<method>" while it runs one).
ROLES = {
    "RolloutWorker": "rollout_worker",
    "RolloutManager": "rollout_manager",
    "ReplayBuffer": "replay_buffer",
    "StoreHost": "store_host",
    "EpisodeStatistics": "episode_statistics",
    "LoggerHub": "logger_hub",
    "RayTrainWorker": "trainer_rank",
    "TrainController": "train_controller",
}


# OpenAI's foundation-model-1x (``mineonline_vpt.configs``) at Crafter's 64x64 frames, trained on one
# 64-step chunk per iteration so that a CPU learner (about 7 frames/s) completes iterations.
VPT_1X = {
    "policy_config": {
        "name": "vpt",
        "hidsize": 1024,
        "impala_width": 4,
        "n_recurrence_layers": 4,
        "attention_heads": 8,
        "attention_memory_size": 256,
        "timesteps": 128,
        "pointwise_ratio": 4,
    },
    "train_config.batch_size_per_gpu": 1,
    "train_config.batches_per_iteration": 1,
    "train_config.epochs_per_iteration": 1,
}


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def classify() -> dict[int, str]:
    """``{pid: role}`` for the driver, every actor of the run and the env processes of workers."""
    roles = {os.getpid(): "driver"}
    actor_pids = {}
    for pid in bl.descendants(os.getpid()):
        title = _title(pid)
        if title.startswith("ray::"):
            name = title[5:].split(".")[0].split()[0]
            if name in ROLES:
                roles[pid] = ROLES[name]
                actor_pids[pid] = ROLES[name]
    for pid, role in actor_pids.items():
        if role == "rollout_worker":
            for kid in bl.descendants(pid):
                roles.setdefault(kid, "env_process")
    return roles


def sample() -> dict[str, dict[str, float]]:
    """Per role: summed RSS, max single-process RSS, max peak (VmHWM), process count (MiB)."""
    out: dict[str, dict[str, float]] = {}
    for pid, role in classify().items():
        st = bl.proc_status_kb(pid)
        if not st:
            continue
        r = out.setdefault(role, {"rss_mib": 0.0, "max_rss_mib": 0.0, "peak_mib": 0.0, "count": 0})
        r["rss_mib"] += st.get("VmRSS", 0) / 1024
        r["max_rss_mib"] = max(r["max_rss_mib"], st.get("VmRSS", 0) / 1024)
        r["peak_mib"] = max(r["peak_mib"], st.get("VmHWM", 0) / 1024)
        r["count"] += 1
    return out


def slope_mib_per_min(times: list[float], values: list[float]) -> float | None:
    """Least-squares slope over the second half of the series."""
    half = len(times) // 2
    t, v = np.asarray(times[half:]), np.asarray(values[half:])
    if len(t) < 3 or np.ptp(t) == 0:
        return None
    return float(np.polyfit(t / 60.0, v, 1)[0])


def summarise(series: list[tuple[float, dict]], peaks: dict[str, float] | None = None) -> dict:
    """Per role: peak RSS (``VmHWM``, also over ``peaks`` seen before the series began), growth over
    the second half, the RSS series and the largest process count."""
    roles = sorted({role for _, snap in series for role in snap})
    times = [t for t, _ in series]

    def column(role: str, key: str) -> list[float]:
        return [snap.get(role, {}).get(key, 0.0) for _, snap in series]

    return {
        "peak_rss_mib": {
            role: round(max([(peaks or {}).get(role, 0.0), *column(role, "peak_mib")]), 1) for role in roles
        },
        "growth_mib_per_min": {role: slope_mib_per_min(times, column(role, "rss_mib")) for role in roles},
        "series": {
            "t_s": [round(t, 1) for t in times],
            **{role: [round(v, 1) for v in column(role, "rss_mib")] for role in roles},
        },
        "process_count": {role: int(max(column(role, "count"), default=0)) for role in roles},
        "minutes": round((times[-1] - times[0]) / 60, 1) if times else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=bl.WORKLOADS, default="crafter")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--num-envs", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="CartPole, 2 envs, 0.5 minutes, 2 s samples")
    parser.add_argument(
        "--vpt", choices=["1x"], default=None, help="a VPT-1x-sized policy (needs mineonline-vpt-policy)"
    )
    parser.add_argument("overrides", nargs="*", help="OmegaConf dotlist overrides, applied last")
    args = parser.parse_args()
    if args.quick:
        args.workload, args.minutes, args.interval, args.num_envs = "cartpole", 0.5, 2.0, 2
    os.environ.setdefault("WANDB_MODE", "disabled")
    import ray

    from mineonline_core.driver.api import run

    outcome: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        name = f"memory-{args.workload}"
        overrides = bl.online_overrides(
            args.workload,
            iterations=10**6,
            run_name=name,
            output_dir=tmp,
            num_envs=args.num_envs,
            extra={
                "rollout_config.replay_buffer_config.max_reuse": 2,
                "rollout_config.replay_buffer_config.max_staleness": 2,
                **(VPT_1X if args.vpt else {}),
            },
        )
        overrides += args.overrides

        def target() -> None:
            try:
                with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the one JSON line
                    outcome["result"] = run({}, overrides, progress=False)
            except BaseException as exc:  # noqa: BLE001 - reported in the JSON line
                outcome["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=target, name="bench-memory-run", daemon=True)
        thread.start()
        series: list[tuple[float, dict]] = []
        start, stop_sent, peaks = time.monotonic(), False, {}
        while thread.is_alive():
            thread.join(timeout=args.interval)
            snap = sample()
            now = time.monotonic() - start
            if "rollout_worker" in snap:  # the run is up
                series.append((now, snap))
            for role, r in snap.items():
                peaks[role] = max(peaks.get(role, 0.0), r["peak_mib"])
            if not stop_sent and series and series[-1][0] - series[0][0] >= 60 * args.minutes:
                try:
                    ray.get_actor(actor_name(name, ROLLOUT_MANAGER), namespace=NAMESPACE).request_stop.remote()
                    stop_sent = True
                except Exception:  # noqa: BLE001 - not up yet or already gone
                    pass
            if now > 60 * args.minutes + 600:
                outcome.setdefault("error", "the run did not stop within 10 minutes of the stop request")
                break
    figures = {**summarise(series, peaks), "status": (outcome.get("result") or {}).get("status")}
    bl.emit(
        "memory",
        figures,
        workload=args.workload,
        minutes=args.minutes,
        quick=args.quick,
        vpt=args.vpt,
        overrides=args.overrides,
        error=outcome.get("error"),
    )


if __name__ == "__main__":
    main()
