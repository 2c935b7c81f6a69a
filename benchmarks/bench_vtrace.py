"""PPO vs V-trace (``mineonline-vtrace``) on CartPole-v1 or Crafter at equal wall clock, through the full loop.

Both trainers run the same example config (``examples/cartpole.yaml`` or ``examples/crafter.py``):
same env, network, rollout and batching keys; only ``trainer_name`` and the algorithm's own
``train_config`` keys differ (the PPO-only keys are dropped for V-trace and ``VTRACE`` applied), and
V-trace lets rollout run ``--vtrace-staleness`` versions ahead. Each run gets ``--wall`` seconds from
the call to ``run`` (start-up included) and at most ``--steps`` env steps.

CartPole: env steps and wall seconds until the 20-episode mean return first reaches 475 (the run
stops there). Crafter: the 20-episode mean return and Crafter score when the wall budget is spent,
beside a random policy measured the same way (about 1.1). Prints ONE JSON line.

    python benchmarks/bench_vtrace.py                                 # CartPole, 120 s each, 150k steps at most
    python benchmarks/bench_vtrace.py --env crafter --wall 600 --steps 100000
    python benchmarks/bench_vtrace.py --only vtrace                   # V-trace alone
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import os
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
NAMESPACE = "mineonline"
TARGET = 475.0

# V-trace's own keys (mineonline_vtrace.VTraceOptions); the loop keys stay those of the example.
VTRACE: dict[str, dict] = {"cartpole": {}, "crafter": {}}


def _config(env: str, trainer: str, staleness: int) -> Any:
    """The example's config for ``trainer``: a dict (CartPole) or a config module (Crafter)."""
    from mineonline_core.config.train import TrainConfig

    if env == "cartpole":
        source, online = None, yaml.safe_load((ROOT / "examples" / "cartpole.yaml").read_text())
    else:
        source = importlib.import_module("examples.crafter")  # importable by name in Ray workers too
        online = copy.deepcopy(source.online_dict)
    online["trainer_name"] = trainer
    if trainer == "VTraceTrainer":
        online["train_config"] = {k: v for k, v in online["train_config"].items() if k in TrainConfig.model_fields}
        online["train_config"].update(VTRACE[env])
        online["rollout_config"]["replay_buffer_config"]["max_staleness"] = staleness
    if source is None:
        return online
    module = types.ModuleType(f"bench_vtrace_{env}")
    # The example may name its policy in policy_config rather than define a policy_generator.
    module.env_generator, module.online_dict = source.env_generator, online
    module.policy_generator = getattr(source, "policy_generator", None)
    return module


def _stopper(
    run_name: str, *, started: float, wall: float, budget: int, target: float | None, done: threading.Event
) -> None:
    """Ask the manager to stop at the wall budget, the env-step budget or the target return."""
    import ray

    hub = manager = None
    while not done.is_set() and (hub is None or manager is None):
        try:
            hub = ray.get_actor(f"{run_name}/logger_hub", namespace=NAMESPACE)
            manager = ray.get_actor(f"{run_name}/rollout_manager", namespace=NAMESPACE)
        except ValueError:
            done.wait(0.5)
    while not done.wait(0.5):
        try:
            latest = ray.get(hub.latest.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the run is ending
            return
        ret, count = latest.get("episode/return_mean"), latest.get("episode/count", 0)
        reached = target is not None and ret is not None and ret >= target and count >= 20
        if reached or latest.get("env_steps", 0) >= budget or time.time() - started >= wall:
            manager.request_stop.remote()
            return


def run_one(env: str, trainer: str, seed: int, out: str, *, wall: float, budget: int, staleness: int) -> dict:
    from mineonline_core.driver.api import run

    run_name = f"bench-vtrace-{env}-{trainer}-seed{seed}-{os.getpid()}"
    target = TARGET if env == "cartpole" else None
    done, started = threading.Event(), time.time()
    thread = threading.Thread(
        target=_stopper,
        args=(run_name,),
        daemon=True,
        kwargs=dict(started=started, wall=wall, budget=budget, target=target, done=done),
    )
    thread.start()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the one JSON line
            result = run(
                _config(env, trainer, staleness),
                [f"seed={seed}", f"run_name={run_name}", f"output_dir={out}"],
                progress=False,
            )
    finally:
        done.set()
    records = [json.loads(line) for line in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    latest: dict = {}
    for record in records:
        latest.update(record)
    row = {
        "trainer": trainer,
        "seed": seed,
        "wall_s": round(time.time() - started, 1),
        "env_steps": int(latest.get("step", 0)),
        "iterations": latest.get("trainer/iteration"),
        "final_return_mean": latest.get("episode/return_mean"),
        "staleness_mean": latest.get("trainer/staleness_mean"),
    }
    if env == "crafter":
        row["final_crafter_score"] = latest.get("crafter/score")
    else:
        hit = next(
            (r for r in records if (r.get("episode/return_mean") or 0) >= TARGET and r.get("episode/count", 0) >= 20),
            None,
        )
        row["steps_to_475"] = int(hit["step"]) if hit else None
        row["wall_s_to_475"] = round(hit["time"] - started, 1) if hit else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", choices=["cartpole", "crafter"], default="cartpole")
    parser.add_argument("--wall", type=float, default=None, help="seconds per run (120 CartPole, 600 Crafter)")
    parser.add_argument("--steps", type=int, default=None, help="env-step cap per run (150k CartPole, 100k Crafter)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument(
        "--vtrace-staleness", type=int, default=4, help="V-trace's max_staleness (PPO keeps the example's)"
    )
    parser.add_argument("--only", choices=["ppo", "vtrace"], default=None)
    parser.add_argument("--quick", action="store_true", help="CartPole, 30 s each: a smoke run of the harness")
    args = parser.parse_args()
    cartpole = args.env == "cartpole"
    wall = 30.0 if args.quick else args.wall or (120.0 if cartpole else 600.0)
    budget = args.steps or (150_000 if cartpole else 100_000)
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
    trainers = [t for t, key in (("PPOTrainer", "ppo"), ("VTraceTrainer", "vtrace")) if args.only in (None, key)]
    out = tempfile.mkdtemp(prefix="bench_vtrace_")
    rows = [
        run_one(args.env, trainer, seed, out, wall=wall, budget=budget, staleness=args.vtrace_staleness)
        for seed in range(args.seeds)
        for trainer in trainers
    ]
    ray.shutdown()
    report: dict = {
        "env": args.env,
        "wall_budget_s": wall,
        "env_step_cap": budget,
        "vtrace_max_staleness": args.vtrace_staleness,
        "vtrace_keys": VTRACE[args.env],
        "runs": rows,
        "quick": args.quick,
    }
    if not cartpole:
        from bench_learning import random_crafter_reward

        report["random_policy_return_mean"] = random_crafter_reward(20)
    from _benchlib import emit

    emit("vtrace", report)


if __name__ == "__main__":
    main()
