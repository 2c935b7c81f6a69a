"""Weight broadcast: time to deliver a new state dict to N rollout workers vs one put + get.

The path is mineonline's (``TrainLoop._publish_weights``): the trainer ``ray.put``s a CPU numpy
state dict once and sends the *ref* (wrapped in a list, so Ray does not resolve it on the way) to
every worker's ``update_weights`` and, without forwarding, to the manager's; each worker ``ray.get``s
it, which on one node maps the object store's buffer without copying, and then copies it into its
standby policy's tensors (``load_state_dict``, off the stepping thread). The actors here are stand-ins
with exactly that path (a real policy of 248M parameters per worker would not fit this shared
machine), so the figure is the transport's.

Figures per (params, N), best of ``--repeats`` (medians beside): ``baseline_ms`` (one ``ray.put`` +
``ray.get`` of the same dict in the driver), ``deliver_ms`` (put → every worker holds the arrays),
``load_ms`` (the copy into the policy, measured in the worker), ``applied_ms`` (put → every worker
acknowledged, load included), ``ratio`` = deliver_ms / baseline_ms (target <= 1.5), and
``zero_copy`` (the arrays the workers got are read-only views of the object store, not copies).

    python benchmarks/bench_broadcast.py --params 1e6,71e6,248e6 --workers 1,2,4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import _benchlib as bl  # noqa: E402

TENSOR_PARAMS = 4_000_000  # VPT's largest matrices are a few million floats each


def fake_state_dict(num_params: int) -> dict[str, np.ndarray]:
    """A float32 state dict of ``num_params`` parameters split like a deep network's."""
    out, left, i = {}, num_params, 0
    while left > 0:
        n = min(TENSOR_PARAMS, left)
        out[f"layers.{i}.weight"] = np.full(n, i, dtype=np.float32)
        left, i = left - n, i + 1
    return out


def make_actors(num_workers: int, num_params: int) -> tuple:
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        """Mimics ``RolloutWorker.update_weights``: resolve the ref, then load into the policy."""

        def __init__(self, num_params: int) -> None:
            self.params = {k: np.empty_like(v) for k, v in fake_state_dict(num_params).items()}  # the "policy"
            self.version = -1

        def update_weights(self, weights: list, version: int) -> dict:
            t0 = time.perf_counter()
            state = ray.get(weights[0])
            got_at = time.time()
            t1 = time.perf_counter()
            for k, v in state.items():  # load_state_dict: the one copy a worker must make
                np.copyto(self.params[k], v)
            t2 = time.perf_counter()
            self.version = version
            zero_copy = all(not v.flags.writeable for v in state.values())
            return {
                "get_ms": 1e3 * (t1 - t0),
                "load_ms": 1e3 * (t2 - t1),
                "zero_copy": zero_copy,
                "got_at": got_at,
                "check": float(self.params[next(iter(self.params))][0]),
            }

    @ray.remote(num_cpus=0)
    class Manager:
        """Mimics ``RolloutManager.update_weights(forward=False)``: records the ref, never the bytes."""

        def __init__(self) -> None:
            self.latest = None

        def update_weights(self, weights: list, version: int) -> None:
            self.latest = (weights, version)

    workers = [Worker.remote(num_params) for _ in range(num_workers)]
    manager = Manager.remote()
    ray.get([w.__ray_ready__.remote() for w in workers] + [manager.__ray_ready__.remote()])
    return manager, workers


def measure(num_params: int, num_workers: int, repeats: int) -> dict:
    import ray

    state = fake_state_dict(num_params)
    manager, workers = make_actors(num_workers, num_params)
    baseline, deliver, applied, load, get, zero_copy = [], [], [], [], [], True
    try:
        for version in range(-1, repeats):  # version -1 is an untimed warm-up round
            t0 = time.perf_counter()
            ref = ray.put(state)
            got = ray.get(ref)
            baseline.append(1e3 * (time.perf_counter() - t0))
            del got, ref
            # Wall clock (one machine): from before the put until the last worker holds the arrays.
            t0, wall0 = time.perf_counter(), time.time()
            ref = ray.put(state)
            calls = [w.update_weights.remote([ref], version) for w in workers]
            manager.update_weights.remote([ref], version)
            acks = ray.get(calls)  # the real trainer does not wait; the stand-in does, to time
            applied.append(1e3 * (time.perf_counter() - t0))
            deliver.append(1e3 * (max(a["got_at"] for a in acks) - wall0))
            del ref
            load.append(max(a["load_ms"] for a in acks))
            get.append(max(a["get_ms"] for a in acks))
            zero_copy &= all(a["zero_copy"] for a in acks)
            if version < 0:
                # The first round of a size pays one-off costs (the object store's pages of that
                # size touched for the first time, the actors' first get): not what a run sees.
                baseline, deliver, applied, load, get = [], [], [], [], []
    finally:
        for actor in [manager, *workers]:
            ray.kill(actor)
    # Load noise only adds time: ``ratio`` compares the best of the repeats, the medians beside it.
    b, d = float(np.min(baseline)), float(np.min(deliver))
    return {
        "params": num_params,
        "workers": num_workers,
        "mbytes": num_params * 4 / 2**20,
        "baseline_ms": b,
        "deliver_ms": d,
        "ratio": d / b,
        "baseline_median_ms": float(np.median(baseline)),
        "deliver_median_ms": float(np.median(deliver)),
        "applied_ms": float(np.median(applied)),
        "worker_get_ms": float(np.median(get)),
        "load_ms": float(np.median(load)),
        "zero_copy": zero_copy,
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="1e6,71e6,248e6", help="comma-separated parameter counts")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1M params, 1 and 2 workers")
    args = parser.parse_args()
    if args.quick:
        args.params, args.workers, args.repeats = "1e6", "2", 2
    sizes = [int(float(p)) for p in args.params.split(",")]
    counts = [int(n) for n in args.workers.split(",")]
    # Room for the largest dict twice (the driver's copy and the object store's); Ray's default is 30% of RAM.
    bl.init_local_ray(num_cpus=2)
    import ray

    rows = []
    try:
        for size in sizes:
            for n in counts:
                rows.append(measure(size, n, args.repeats))
                print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    worst = max(r["ratio"] for r in rows)
    bl.emit(
        "broadcast",
        {"rows": rows, "worst_ratio": worst, "all_zero_copy": all(r["zero_copy"] for r in rows)},
        target_ratio=1.5,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
