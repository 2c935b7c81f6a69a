"""The trainer's side of a weight broadcast (issue 24): what ``broadcast_model_to_rollout_workers``
costs the training loop, before and after the broadcast thread.

``sync`` is the path before issue 24, reproduced here: the state dict to numpy, a per-array finite
scan, ``ray.put`` and the ``update_weights`` calls, all on the trainer's thread. ``async`` is
``TrainLoop``'s: a snapshot on the rank's device and one fused finite check on the trainer's
thread; the host copy, ``ray.put`` and the calls on the broadcast thread. A real ``PPOTrainer``
holds an MLP of about ``--mbytes`` MB of float32 weights; one receiving actor gets each version as
a rollout worker does (``ray.get`` of the ref, copy into its weights), another records it as the
manager does. Each round changes every weight (an optimiser step), publishes a new version, then
"trains" for ``--train-ms`` (sleeping: the broadcast thread has the cores, as it would during a GPU
rank's step; on this shared 2-core machine a busy CPU loop would measure the neighbours).

Figures per path, medians over ``--rounds`` after a warm-up round: ``trainer_ms`` (the call's time
on the trainer's thread, ``perf/broadcast_ms``), ``delivered_ms`` (call → the worker holds the
version), ``send_ms`` (async: the broadcast thread's time, ``perf/broadcast_send_ms``).

    python benchmarks/bench_publish.py --mbytes 150 --rounds 4 --train-ms 500   # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _benchlib as bl  # noqa: E402


def make_receiver():
    import ray

    @ray.remote(num_cpus=0)
    class Receiver:
        """``update_weights`` as a rollout worker takes it (get, copy into its weights), or as the
        manager does (``keep=False``: the ref only)."""

        def __init__(self, keep: bool) -> None:
            self.keep, self.params, self.got = keep, None, {}

        def update_weights(self, weights: list, version: int, forward: bool = True) -> None:
            if self.keep:
                state = ray.get(weights[0])
                if self.params is None:
                    self.params = {k: np.empty_like(v) for k, v in state.items()}
                for k, v in state.items():
                    np.copyto(self.params[k], v)
            self.got[version] = time.time()

        def arrived(self, version: int) -> float | None:
            return self.got.get(version)

    return Receiver


def sync_publish(trainer) -> None:
    """The trainer's broadcast before issue 24 (``_publish_weights`` at 7b69085), on its own thread."""
    import ray

    from mineonline_core.services.finite import _nonfinite_count
    from mineonline_core.trainer.sequence import unwrap

    weights = {k: v.detach().cpu().numpy() for k, v in unwrap(trainer.model).state_dict().items()}
    hits = [k for k, v in weights.items() if _nonfinite_count(v)]  # require_finite's per-array numpy scan
    assert not hits
    refs = [ray.put(weights)]
    for worker in trainer._workers:
        worker.update_weights.remote(refs, trainer.version)
    trainer.rollout_manager.update_weights.remote(refs, trainer.version, forward=not trainer._workers)


def measure(trainer, worker, path: str, rounds: int, train_s: float) -> dict:
    import ray

    trainer_ms, delivered_ms, send_ms = [], [], []
    for round_ in range(rounds + 1):  # round 0 warms the object store's pages and the thread up
        with torch.no_grad():
            for p in trainer.policy.parameters():
                p.add_(1e-3)  # the optimiser step
        trainer.version += 1
        wall, start = time.time(), time.perf_counter()
        if path == "sync":
            sync_publish(trainer)
        else:
            trainer._publish_weights()
        took = 1e3 * (time.perf_counter() - start)
        time.sleep(train_s)  # the next iteration's training, while the broadcast thread sends
        while (arrived := ray.get(worker.arrived.remote(trainer.version))) is None:
            time.sleep(0.01)
        if path == "async":
            trainer.flush_broadcast()
            send_ms.append(trainer.perf["perf/broadcast_send_ms"])
        if round_:
            trainer_ms.append(took)
            delivered_ms.append(1e3 * (arrived - wall))
    out = {
        "path": path,
        "trainer_ms": statistics.median(trainer_ms),
        "trainer_ms_all": trainer_ms,
        "delivered_ms": statistics.median(delivered_ms),
    }
    if send_ms:
        out["send_ms"] = statistics.median(send_ms[1:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbytes", type=float, default=150.0, help="float32 weights of the MLP, in MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-ms", type=float, default=1000.0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the in-process rank's num_cpus_per_worker)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bl.init_local_ray(num_cpus=2)
    import ray

    from mineonline_core.config import OnlineConfig
    from mineonline_core.builtin.models import MLPPolicy
    from mineonline_ppo import PPOTrainer
    from mineonline_core.trainer.loop import TrainLoop

    hidden = int((args.mbytes * 2**20 / 8) ** 0.5)  # actor and critic: a hidden x hidden layer each dominates
    policy = functools.partial(MLPPolicy, obs_dim=4, num_actions=2, hidden_sizes=[hidden, hidden])
    config = OnlineConfig(train_config={"kl_divergence_coef_rho": 0.0})
    Receiver = make_receiver()
    worker, manager = Receiver.remote(True), Receiver.remote(False)
    try:
        trainer = TrainLoop(
            algorithm=PPOTrainer,
            rollout_manager=manager,
            policy_generator=policy,
            env_generator=None,
            config=config,
            run_dir=os.path.join("/tmp", f"bench_publish_{os.getpid()}"),
        )
        trainer.setup_rank(local=True)
        trainer._workers = [worker]
        mbytes = sum(v.numel() * v.element_size() for v in trainer.policy.state_dict().values()) / 2**20
        rows = [measure(trainer, worker, path, args.rounds, args.train_ms / 1e3) for path in ("sync", "async")]
    finally:
        ray.kill(worker)
        ray.kill(manager)
        ray.shutdown()
    for row in rows:
        bl.emit(
            "publish",
            {"mbytes": round(mbytes, 1), **row},
            rounds=args.rounds,
            train_ms=args.train_ms,
            threads=args.threads,
        )


if __name__ == "__main__":
    main()
