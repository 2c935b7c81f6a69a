"""Collection ceiling vs achieved: how much of the plain-process env throughput mineonline keeps.

* ceiling: the same envs stepped in subprocesses (gymnasium ``AsyncVectorEnv``, shared memory) with
  the same batched policy forward, in one plain process: no Ray, no fragments, no buffer.
* collector: mineonline's ``FragmentCollector`` (env processes, batched inference, fragment
  assembly) in this process, without Ray: isolates the per-step cost of fragments.
* actor: a real ``RolloutManager`` on a private local Ray cluster, its workers writing fragments into
  the store (``--store``, LMDB by default) and announcing them to the replay buffer, while no learner
  consumes (the buffer evicts). Measured from the manager's own ``status()["env_steps"]``.

``*_detail.cpu_ms_per_step`` is the stepping process's own CPU per env step (env processes excluded):
on a loaded machine it is the stable figure, and ``collector_cpu_tax_ms_per_step`` is the framework's
extra CPU per step over the plain loop.

Prints one JSON line; ``ratio_actor`` (achieved / ceiling) has the target >= 0.85 on Crafter.

    python benchmarks/bench_collection.py --workload crafter --num-envs 4 --seconds 30
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import _benchlib as bl  # noqa: E402


def collector_steps_per_s(
    workload: str, *, num_envs: int, batch_size: int, fragment_length: int, seconds: float
) -> dict:
    """Env steps/s of the Ray-free ``FragmentCollector`` (fragments built, then dropped)."""
    from mineonline_core.testing import kit as tk

    fn = bl.env_generator(workload)
    probe = fn()
    policy = bl.build_policy(workload, probe)
    probe.close()
    collector = tk.collector(
        policy=policy,
        env_fns=[fn] * num_envs,
        fragment_length=fragment_length,
        batch_size=batch_size,
        discount=0.99,
        seed=0,
    )
    try:
        while collector.env_steps < 20 * num_envs:  # warm-up: env processes built, first resets done
            collector.step()
        collector.metrics()  # drop the warm-up timings
        steps0, start, cpu0 = collector.env_steps, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            collector.step()
            collector.pop_fragments()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
        perf = {k: v for k, v in collector.metrics().items() if k.startswith("perf/")}
        steps = collector.env_steps - steps0
    finally:
        collector.close()
    return {
        "steps_per_s": steps / elapsed,
        "steps": steps,
        "seconds": elapsed,
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "perf": perf,
    }


def online_dict(
    workload: str, *, num_envs: int, batch_size: int, fragment_length: int, run_dir: str, store: str
) -> dict:
    return {
        "run_name": f"bench-collection-{os.getpid()}",
        "output_dir": os.path.dirname(run_dir),
        "env_config": bl.env_config(workload),
        "policy_config": bl.policy_config(workload),
        "logger_config": {"loggers": []},
        "rollout_config": {
            "num_rollout_workers": 1,
            "num_cpus_per_worker": 1,
            "fragment_length": fragment_length,
            "worker_config": {"num_envs": num_envs, "batch_size": batch_size},
            "replay_buffer_config": {"max_chunks": 64, "database_config": {"backend": store}},
        },
        "train_config": {"num_workers": 1, "num_iterations": 1, "context_length": fragment_length},
    }


def worker_steps(manager: object) -> int:
    """Env steps of every worker, read from the workers themselves (the manager's own total is
    refreshed only every report interval)."""
    import ray

    return sum(w.get("env_steps", 0) for w in ray.get(manager.status.remote())["workers"])


def actor_steps_per_s(
    workload: str, *, num_envs: int, batch_size: int, fragment_length: int, seconds: float, store: str
) -> dict:
    """Env steps/s of a real RolloutManager + RolloutWorker + ReplayBuffer + store, learner idle."""
    import ray

    from mineonline_core.config import load_config
    from mineonline_core.contracts.envs import adapted
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.contracts.policy import prepare_policy
    from mineonline_core.driver.resolve import resolve
    from mineonline_core.rollout.manager import launch_rollout_manager

    with tempfile.TemporaryDirectory(prefix="bench-collection-") as tmp:
        run_dir = os.path.join(tmp, "run")
        resolved = resolve(
            load_config(
                online_dict(
                    workload,
                    num_envs=num_envs,
                    batch_size=batch_size,
                    fragment_length=fragment_length,
                    run_dir=run_dir,
                    store=store,
                )
            ),
            get_plugin_manager(),
        )
        cfg = resolved.config
        bl.init_local_ray()
        manager = None
        try:
            manager = launch_rollout_manager(
                policy_generator=resolved.policy_generator,
                env_generator=adapted(resolved.env_generator),
                config=cfg,
                store_cls=resolved.store_cls,
                store_options=resolved.store_options,
            )
            ray.get(manager.wait_ready.remote(300.0))
            # Workers step only once they hold weights: publish version 0 as the trainer would.
            policy = prepare_policy(resolved.policy_generator(), use_normalized_vf=cfg.train_config.use_normalized_vf)
            state = {k: v.detach().cpu().numpy() for k, v in policy.state_dict().items()}
            ray.get(manager.update_weights.remote([ray.put(state)], 0))
            # Warm-up until the worker streams (first fragments written), then a measured window.
            deadline = time.monotonic() + 120
            while worker_steps(manager) < 20 * num_envs and time.monotonic() < deadline:
                time.sleep(0.2)
            # The rollout side's CPU: the worker (envs' parent), and the actors it feeds.
            pids = [
                p
                for cls in ("RolloutWorker", "StoreHost", "ReplayBuffer", "RolloutManager")
                for p in bl.actor_pids(cls)
            ]
            s0, t0, c0 = worker_steps(manager), time.perf_counter(), sum(map(bl.proc_cpu_s, pids))
            time.sleep(seconds)  # a measurement window, not a synchronisation
            s1, c1 = worker_steps(manager), sum(map(bl.proc_cpu_s, pids))
            elapsed = time.perf_counter() - t0
            buffer_stats = ray.get(ray.get(manager.get_buffer.remote()).stats.remote())
        finally:
            if manager is not None:
                try:
                    ray.get(manager.shutdown.remote(), timeout=60)
                finally:
                    ray.kill(manager)
            ray.shutdown()
    steps = s1 - s0
    return {
        "steps_per_s": steps / elapsed,
        "steps": steps,
        "seconds": elapsed,
        "cpu_ms_per_step": 1e3 * (c1 - c0) / max(steps, 1) if pids else None,
        "worker_pids_found": len(pids),
        "buffer": {k: v for k, v in buffer_stats.items() if isinstance(v, (int, float))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=bl.WORKLOADS, default="crafter")
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None, help="default: num_envs (the ceiling is synchronous)")
    parser.add_argument("--fragment-length", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each mode")
    parser.add_argument("--modes", default="ceiling,collector,actor")
    parser.add_argument("--store", default="lmdb", help="database_config.backend of the actor mode (lmdb, memory)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (CartPole, 2 envs, 2 s windows)")
    args = parser.parse_args()
    if args.quick:
        args.workload, args.num_envs, args.seconds, args.fragment_length = "cartpole", 2, 1.0, 16
    batch_size = args.batch_size or args.num_envs
    # A rollout worker actor reserves one CPU and Ray sets its torch to one thread: do the same here.
    torch.set_num_threads(1)
    modes = [m for m in args.modes.split(",") if m]
    figures: dict = {}
    errors: dict = {}
    for mode in modes:
        fn = {
            "ceiling": lambda: bl.ceiling_steps_per_s(args.workload, num_envs=args.num_envs, seconds=args.seconds),
            "collector": lambda: collector_steps_per_s(
                args.workload,
                num_envs=args.num_envs,
                batch_size=batch_size,
                fragment_length=args.fragment_length,
                seconds=args.seconds,
            ),
            "actor": lambda: actor_steps_per_s(
                args.workload,
                num_envs=args.num_envs,
                batch_size=batch_size,
                fragment_length=args.fragment_length,
                seconds=args.seconds,
                store=args.store,
            ),
        }[mode]
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - the loop is being built; report, don't crash the set
            errors[mode] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            continue
        figures[f"{mode}_steps_per_s"] = result.pop("steps_per_s")
        figures[f"{mode}_detail"] = result
    ceiling = figures.get("ceiling_steps_per_s")
    if "ceiling_detail" in figures and "collector_detail" in figures:
        # The framework's CPU tax per step in the stepping process (load-independent, unlike rates).
        figures["collector_cpu_tax_ms_per_step"] = (
            figures["collector_detail"]["cpu_ms_per_step"] - figures["ceiling_detail"]["cpu_ms_per_step"]
        )
    if "ceiling_detail" in figures and (figures.get("actor_detail") or {}).get("cpu_ms_per_step") is not None:
        figures["actor_cpu_tax_ms_per_step"] = (
            figures["actor_detail"]["cpu_ms_per_step"] - figures["ceiling_detail"]["cpu_ms_per_step"]
        )
    for mode in ("collector", "actor"):
        if ceiling and f"{mode}_steps_per_s" in figures:
            figures[f"ratio_{mode}"] = figures[f"{mode}_steps_per_s"] / ceiling
    bl.emit(
        "collection",
        figures,
        workload=args.workload,
        num_envs=args.num_envs,
        batch_size=batch_size,
        fragment_length=args.fragment_length,
        store=args.store,
        target_ratio=0.85,
        errors=errors,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
