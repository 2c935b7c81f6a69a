"""VPT-1x forward throughput: rollout inference (B=8, T=1, with state) and training chunks (T=64,
forward with grad + backward), random initialisation. Prints ONE JSON line.

    PYTHONPATH=.:plugins/vpt_policy python benchmarks/bench_vpt.py            # ~2-3 min on 2 CPU cores
    PYTHONPATH=.:plugins/vpt_policy python benchmarks/bench_vpt.py --quick    # seconds, a smoke run

``frames_per_s`` counts env frames (B*T) per second of wall time, after one untimed warm-up call.
``cpu_frames_per_s`` divides by the process's CPU time instead (user + system, all threads): on a
shared machine it shows what the code costs, not how busy the neighbours are.
``peak_rss_mib`` is the process's peak resident memory; on CUDA ``peak_gpu_mib`` is also reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time

import torch

from mineonline_vpt import VPTPolicy
from mineonline_vpt.configs import FOUNDATION_KWARGS, FOUNDATION_TEMPERATURE


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(b: int, t: int, hw: int, device: torch.device) -> tuple[dict, dict]:
    img = torch.randint(0, 256, (b, t, hw, hw, 3), dtype=torch.uint8, device=device)
    first = torch.zeros(b, t, dtype=torch.bool, device=device)
    first[:, 0] = True
    return {"image": img}, {"first": first}


def bench_rollout(policy: VPTPolicy, *, batch: int, steps: int, hw: int, device: torch.device, amp: bool) -> dict:
    state = policy.initial_state(batch)
    obs, ctx = _batch(batch, 1, hw, device)
    ctx["first"][:] = False
    with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        _, state = policy(obs, state, ctx)  # warm-up (allocations, kernel selection)
        _sync(device)
        start, cpu = time.perf_counter(), _cpu_s()
        for _ in range(steps):
            latents, state = policy(obs, state, ctx)
            policy.pi_head.sample(latents["pi_logits"])
        _sync(device)
    elapsed, cpu = time.perf_counter() - start, _cpu_s() - cpu
    return {
        "batch": batch,
        "T": 1,
        "calls": steps,
        "s_per_call": elapsed / steps,
        "frames_per_s": batch * steps / elapsed,
        "cpu_frames_per_s": batch * steps / cpu,
    }


def bench_train(
    policy: VPTPolicy, *, batch: int, t: int, repeats: int, hw: int, device: torch.device, amp: bool
) -> dict:
    obs, ctx = _batch(batch, t, hw, device)
    action = {
        "buttons": torch.zeros(batch, t, 1, dtype=torch.long, device=device),
        "camera": torch.full((batch, t, 1), 60, dtype=torch.long, device=device),
    }

    def step(steps: int = t) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            latents, _ = policy(
                {"image": obs["image"][:, :steps]}, policy.initial_state(batch), {"first": ctx["first"][:, :steps]}
            )
            act = {k: v[:, :steps] for k, v in action.items()}
            logp = policy.pi_head.logprob(act, latents["pi_logits"])
            loss = -logp.mean() + latents["vpred"].float().pow(2).mean()
        loss.backward()
        policy.zero_grad(set_to_none=True)

    # Warm-up: a full-size call on GPU (kernel selection); a short one on CPU, where a full one costs
    # minutes and the first call's extra cost is only allocation.
    step(t if device.type == "cuda" else min(t, 4))
    _sync(device)
    start, cpu = time.perf_counter(), _cpu_s()
    for _ in range(repeats):
        step()
    _sync(device)
    elapsed, cpu = time.perf_counter() - start, _cpu_s() - cpu
    return {
        "batch": batch,
        "T": t,
        "iterations": repeats,
        "s_per_iter": elapsed / repeats,
        "frames_per_s": batch * t * repeats / elapsed,
        "cpu_frames_per_s": batch * t * repeats / cpu,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="foundation-model-1x", choices=sorted(FOUNDATION_KWARGS))
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    parser.add_argument("--quick", action="store_true", help="a tiny run: T=8, B=1, few calls")
    parser.add_argument("--train-batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--train-t", type=int, default=64)
    parser.add_argument("--rollout-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed training iterations per batch size")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the ImpalaCNN")
    args = parser.parse_args(argv)

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    on_gpu = device.type == "cuda"
    train_batches = [1] if args.quick else args.train_batches
    train_t = 8 if args.quick else args.train_t
    rollout_steps = args.rollout_steps or (3 if args.quick else (200 if on_gpu else 10))
    repeats = args.repeats or (1 if args.quick or not on_gpu else 10)

    torch.manual_seed(0)
    policy = VPTPolicy.from_vpt_kwargs(FOUNDATION_KWARGS[args.model], temperature=FOUNDATION_TEMPERATURE).to(device)
    policy.net.img_process.cnn.gradient_checkpointing = args.checkpointing
    hw = policy.net.img_shape[0]
    policy.eval()  # no dropout/batch-norm in VPT: eval only marks intent for rollout
    rollout = bench_rollout(policy, batch=8, steps=rollout_steps, hw=hw, device=device, amp=args.amp)
    policy.train()
    train = [
        bench_train(policy, batch=b, t=train_t, repeats=repeats, hw=hw, device=device, amp=args.amp)
        for b in train_batches
    ]
    result = {
        "bench": "vpt_forward",
        "model": args.model,
        "params": sum(p.numel() for p in policy.parameters()),
        "device": torch.cuda.get_device_name(device)
        if on_gpu
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch_threads": torch.get_num_threads(),
        "amp_bf16": args.amp,
        "gradient_checkpointing": args.checkpointing,
        "quick": args.quick,
        "rollout": rollout,
        "train": train,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if on_gpu:
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
