"""What a Crafter pixel policy costs on this CPU at the tuned-PPO batch shape: the figure that decides
which network a 2-core machine can train for 1M env steps within the issue-19 budget of 75 minutes.

For each policy: the seconds of one training iteration of ``examples/crafter.py`` (3 epochs x 8
minibatches of 8 chunks x 64 steps: forward, backward and an Adam step on 512 images each), the
milliseconds of the rollout's batched forward over 8 envs, and both projected to 1M env steps (244
iterations; learner and rollout share the machine, so the two add up on a loaded CPU). Torch runs with
one intra-op thread, as Ray gives the train worker (``num_cpus_per_worker`` 1). Prints ONE JSON line.

    python benchmarks/bench_policy_cost.py
    python benchmarks/bench_policy_cost.py --quick       # the Nature CNN and the narrowest ResNet, 1 repeat
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

# name -> (policy, options): the Nature CNN of examples/crafter.py, then IMPALA-ResNets from narrow to Moon et al.'s.
POLICIES: dict[str, tuple[str, dict]] = {
    "cnn": ("cnn", {}),
    "impala_resnet 16/32/32, 1 block, dense 256": (
        "impala_resnet",
        {"channels": [16, 32, 32], "blocks_per_stage": 1, "dense_sizes": [256]},
    ),
    "impala_resnet 16/32/32, 2 blocks, no norms, dense 256": (
        "impala_resnet",
        {
            "channels": [16, 32, 32],
            "blocks_per_stage": 2,
            "group_norm": False,
            "layer_norm": False,
            "dense_sizes": [256],
        },
    ),
    "impala_resnet 32/64/64, 1 block, dense 256/512": (
        "impala_resnet",
        {"channels": [32, 64, 64], "blocks_per_stage": 1, "dense_sizes": [256, 512]},
    ),
    "impala_resnet 64/128/128, 2 blocks, dense 256/1024 (Moon et al.)": ("impala_resnet", {}),
}
ITERATIONS_PER_1M = 1_000_000 / 4096


def measure(name: str, options: dict, *, repeats: int) -> dict:
    import gymnasium as gym
    import numpy as np
    import torch

    from mineonline_core.builtin.models import CNNPolicy, ImpalaResNetPolicy

    cls = {"cnn": CNNPolicy, "impala_resnet": ImpalaResNetPolicy}[name]
    space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
    policy = cls.build(cls.Config(**options), observation_space=space, action_space=gym.spaces.Discrete(17))
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    images = torch.randint(0, 256, (8, 64, 64, 64, 3), dtype=torch.uint8)  # one minibatch: 8 chunks x 64 steps
    context = {"first": torch.zeros(8, 64, dtype=torch.bool)}

    def train_step() -> None:
        out, _ = policy({"image": images}, None, context)
        loss = out["pi_logits"].logsumexp(-1).mean() + out["vpred"].square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    train_step()  # untimed: the first call allocates
    start = time.perf_counter()
    for _ in range(repeats):
        train_step()
    train_s = (time.perf_counter() - start) / repeats
    step = torch.randint(0, 256, (8, 1, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        policy({"image": step}, None, {"first": torch.zeros(8, 1, dtype=torch.bool)})
        start = time.perf_counter()
        for _ in range(20 * repeats):
            policy({"image": step}, None, {"first": torch.zeros(8, 1, dtype=torch.bool)})
        infer_s = (time.perf_counter() - start) / (20 * repeats)
    train_iteration_s = 24 * train_s  # 3 epochs x 8 minibatches
    inference_iteration_s = 512 * infer_s  # 4096 steps in batches of 8
    return {
        "params_m": round(sum(p.numel() for p in policy.parameters()) / 1e6, 3),
        "train_iteration_s": round(train_iteration_s, 2),
        "inference_ms_per_batch_of_8": round(1e3 * infer_s, 2),
        "projected_1m_compute_min": round(ITERATIONS_PER_1M * (train_iteration_s + inference_iteration_s) / 60, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="timed training steps per policy")
    parser.add_argument("--quick", action="store_true", help="the CNN and the narrowest ResNet, one repeat")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    names = list(POLICIES)[:2] if args.quick else list(POLICIES)
    repeats = 1 if args.quick else args.repeats
    figures = {}
    for label in names:
        name, options = POLICIES[label]
        figures[label] = measure(name, options, repeats=repeats)
        print(f"{label:66s} {figures[label]}", file=sys.stderr, flush=True)
    from _benchlib import emit

    emit("policy_cost", {"policies": figures, "torch_threads": 1, "quick": args.quick})


if __name__ == "__main__":
    main()
