"""The in-process measurement pieces of ``bench_gpu.py`` (issue 24): the flagship's trainer, version-0 chunks, the
precision rows and the trainer-config rows, and the one-JSON-line output every part prints.

They run inside ``bench_gpu.py``'s child process for the ``inprocess`` part (``emit`` and ``log`` in every
part's child): the project's ``PPOTrainer`` built as the in-process rank builds it, on the GPU when there is
one. Nothing here is a project dependency: like ``_benchlib``, the module lives next to the scripts and is
imported by name (``bench_gpu.py`` puts its folder on sys.path).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import _benchlib as bl
import numpy as np
import torch

CONFIG = bl.ROOT / "examples" / "flagship_vpt2x.yaml"
# The flagship shrunk to seconds on a CPU: tiny VPT, 32x32 frames, 1 worker x 2 envs, 2 chunks of 16 steps.
QUICK_OVERRIDES = [
    "policy_config.hidsize=32",
    "policy_config.impala_width=1",
    "policy_config.impala_chans=[8,8,8]",
    "policy_config.attention_heads=2",
    "policy_config.n_recurrence_layers=1",
    "policy_config.attention_memory_size=16",
    "policy_config.timesteps=8",
    "env_config.size=32",
    "rollout_config.num_rollout_workers=1",
    "rollout_config.num_gpus_per_worker=0",
    "rollout_config.num_cpus_per_worker=0.5",
    "rollout_config.fragment_length=16",
    "rollout_config.worker_config.num_envs=2",
    "rollout_config.worker_config.batch_size=2",
    "rollout_config.replay_buffer_config.max_chunks=16",
    "rollout_config.replay_buffer_config.fragments_per_report=2",
    "train_config.num_gpus_per_worker=0",
    "train_config.num_cpus_per_worker=1",
    "train_config.batch_size_per_gpu=1",
    "train_config.batches_per_iteration=2",
    "train_config.context_length=8",
]


def _significant(value: Any) -> Any:
    """Floats to 4 significant digits (``bl.emit`` rounds to 4 decimals: a 1e-5 log-prob error is a figure here)."""
    if isinstance(value, dict):
        return {k: _significant(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_significant(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(f"{float(value):.4g}")
    return value


def emit(part: str, figures: dict, quick: bool) -> None:
    """Print the part's one JSON line (``bl.emit``'s keys, with ``part``)."""
    print(
        json.dumps(
            {
                "bench": "gpu",
                "part": part,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **bl.machine(),
                "quick": quick,
                **_significant(figures),
            }
        ),
        flush=True,
    )


def log(message: str) -> None:
    """Progress on stderr: the parent reports its tail when a part fails or runs out of time."""
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_trainer(overrides: list[str], run_dir: str, device: torch.device) -> Any:
    """The flagship's trainer, built as the in-process rank builds it (``setup_rank(local=True)`` on ``device``)."""
    from mineonline_core.config import load_config
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve
    from mineonline_core.trainer import build_loop

    resolved = resolve(load_config(str(CONFIG), overrides), get_plugin_manager())
    trainer = build_loop(
        resolved.trainer_cls,
        rollout_manager=None,
        policy_generator=resolved.policy_generator,
        env_generator=resolved.env_generator,
        config=resolved.config,
        run_dir=run_dir,
        options=resolved.trainer_options,
    )
    trainer.setup_rank(local=True, device=device)
    return trainer


def set_precision(trainer: Any, *, amp: bool, tf32: bool, amp_dtype: str = "auto") -> Any:
    """Set ``use_amp``, ``amp_dtype`` and ``allow_tf32`` and apply them as a rank does (the project's one
    precision decision, ``config/precision.py``: TF32 switches, scaler); returns that decision."""
    from mineonline_core.config.precision import PrecisionChoice

    train_config = trainer.train_config
    train_config.use_amp, train_config.amp_dtype, train_config.allow_tf32 = amp, amp_dtype, tf32
    precision = PrecisionChoice.from_config(train_config).on(trainer.device)
    precision.apply_tf32()
    trainer.scaler = precision.make_scaler()
    return precision


def _flags(precision: Any) -> dict:
    return {
        "autocast_dtype": precision.dtype,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "grad_scaler": precision.grad_scaler,
    }


def _squeeze_steps(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.reshape(b, -1)[:, 0]


@torch.inference_mode()
def step_through(
    policy: Any, img: torch.Tensor, first: torch.Tensor, action: Any = None, keep_states: range = range(0)
) -> dict:
    """Rollout's numerics: the policy one step at a time over (B, L) frames, state carried, fp32.
    Samples actions unless ``action`` (leaves (B, L, ...)) is given; returns per-step ``action``,
    ``logprob``, ``vpred`` (denormalised) and ``states[t]``, the recurrent state before step t for t
    in ``keep_states`` (fragment starts; VPT-2x holds 8 MiB per chunk and step, so no more)."""
    from mineonline_core.contracts.tree import tree_map

    b, length = first.shape
    state = policy.initial_state(b)
    actions, logps, vpreds, states = [], [], [], {}
    for t in range(length):
        if t in keep_states:
            states[t] = tree_map(lambda x: x.cpu(), state)
        latents, state = policy(
            input={"image": img[:, t : t + 1]}, state_in=state, context={"first": first[:, t : t + 1]}
        )
        logits = latents["pi_logits"]
        act = policy.pi_head.sample(logits) if action is None else tree_map(lambda a: a[:, t : t + 1], action)
        actions.append(act)
        logps.append(_squeeze_steps(policy.pi_head.logprob(act, logits).float(), b))
        vpreds.append(_squeeze_steps(policy.value_head.denormalize(latents["vpred"]).float(), b))
    return {
        "action": tree_map(lambda *xs: torch.cat(xs, 1), *actions),
        "logprob": torch.stack(logps, 1),
        "vpred": torch.stack(vpreds, 1),
        "states": states,
    }


def make_chunks(
    policy: Any,
    *,
    n_chunks: int,
    fragments_per_chunk: int,
    fragment_length: int,
    hw: int,
    device: torch.device,
    seed: int = 0,
) -> tuple[list[list[dict]], dict]:
    """Version-0 chunks with every fragment column, behaviour columns from ``policy`` itself; also
    the raw tensors (frames, firsts, actions) for the precision part."""
    from mineonline_core.contracts import fragment as F
    from mineonline_core.contracts.tree import tree_map

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    length = fragments_per_chunk * fragment_length
    img = torch.randint(0, 256, (n_chunks, length + 1, hw, hw, 3), dtype=torch.uint8, generator=gen).to(device)
    # About one chunk in three ends an episode inside it (two thirds terminated, one third truncated).
    ends = np.zeros((n_chunks, length), bool)
    for i in range(n_chunks):
        if rng.random() < 0.33:
            ends[i, rng.integers(length // 4, length - 1)] = True
    terminated = ends & (rng.random(ends.shape) < 0.67)
    truncated = ends & ~terminated
    first = np.zeros_like(ends)
    first[:, 0] = rng.random(n_chunks) < 0.25
    first[:, 1:] = ends[:, :-1]
    first_t = torch.as_tensor(first, device=device)
    policy.eval()
    behaviour = step_through(policy, img[:, :length], first_t, keep_states=range(0, length, fragment_length))
    policy.train()
    action = tree_map(lambda a: a.cpu().numpy(), behaviour["action"])
    logprob, vpred = behaviour["logprob"].cpu().numpy(), behaviour["vpred"].cpu().numpy()
    episode = np.cumsum(np.concatenate([np.zeros((n_chunks, 1), bool), ends[:, :-1]], 1), axis=1)
    img_np = img.cpu().numpy()
    chunks = []
    for i in range(n_chunks):
        fragments = []
        for k in range(fragments_per_chunk):
            s = slice(k * fragment_length, (k + 1) * fragment_length)
            # The reference is the initial policy: at version 0 its state is the policy's (same weights).
            state_in = tree_map(lambda x: x[i : i + 1].numpy().copy(), behaviour["states"][s.start])
            fragments.append(
                {
                    F.OBS: {"image": img_np[i, s]},
                    F.NEXT_OBS: {"image": img_np[i, s.stop : s.stop + 1]},
                    F.ACTION: tree_map(lambda a: a[i, s], action),
                    F.REWARD: (rng.random(fragment_length) < 0.02).astype(np.float32),
                    F.TERMINATED: terminated[i, s].copy(),
                    F.TRUNCATED: truncated[i, s].copy(),
                    F.FIRST: first[i, s].copy(),
                    F.LOGPROB: logprob[i, s].copy(),
                    F.VPRED: vpred[i, s].copy(),
                    F.BOOTSTRAP: np.where(truncated[i, s], vpred[i, s], 0.0).astype(np.float32),
                    F.EPISODE_ID: episode[i, s].astype(np.int64),
                    F.VERSION: np.zeros(fragment_length, np.int64),
                    F.STATE_IN: state_in,
                    F.REF_STATE_IN: state_in,
                    F.STREAM: f"0.0.{i}",
                    F.INDEX: k,
                    F.WORKER_ID: 0,
                    F.ENV_ID: i,
                }
            )
        chunks.append(fragments)
    del behaviour["states"]
    return chunks, {"img": img[:, :length], "first": first_t, **behaviour}


# Training numerics against rollout's. The project's policy: rollout steps in the training dtype with
# the same TF32 switches (fp32, fp32_tf32, amp). Before it, for comparison: PyTorch's default switches
# (TF32 convolutions, fp32 matmuls) on both sides, and bf16 training against fp32 rollout.
PRECISION = {
    "fp32": dict(amp=False, tf32=False),
    "fp32_tf32": dict(amp=False, tf32=True),
    "amp": dict(amp=True, tf32=False),
    "before_fp32_pytorch_defaults": dict(amp=False, tf32=False, pytorch_defaults=True),
    "before_amp_fp32_rollout": dict(amp=True, tf32=False, fp32_rollout=True),
}


PRECISION_CHUNKS = 8  # enough steps for the fractions; the whole iteration's pass would add memory, not information


def precision_rows(trainer: Any, chunks: list[list[dict]], raw: dict, device: torch.device) -> dict:
    from mineonline_core.contracts.tree import tree_map
    from mineonline_core.trainer.batch import assemble_chunks

    clip = float(getattr(trainer.options, "ppo_clip", 0.2))
    n = min(PRECISION_CHUNKS, len(chunks))
    chunks, raw = chunks[:n], tree_map(lambda x: x[:n], {k: raw[k] for k in ("img", "first", "action")})
    rows = {}
    for name, setting in PRECISION.items():
        try:
            setting = dict(setting)
            pytorch_defaults, fp32_rollout = setting.pop("pytorch_defaults", False), setting.pop("fp32_rollout", False)
            precision = set_precision(trainer, **setting)
            if pytorch_defaults:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
            flags = {**_flags(precision), "rollout_dtype": None if fp32_rollout else precision.dtype}
            # Rollout: one step at a time, under the precision a rollout worker applies (the collector's autocast).
            rollout = torch.autocast(device.type, enabled=False) if fp32_rollout else precision.autocast()
            trainer.policy.eval()
            with rollout:
                behaviour = step_through(trainer.policy, raw["img"], raw["first"], action=raw["action"])["logprob"]
            batch = assemble_chunks(chunks, device=device)
            with trainer.algorithm.autocast():
                train_logp = trainer.current_policy_outputs(batch=batch)["logprob"]
            err = (train_logp.float() - behaviour.to(train_logp.device)).abs()
            off = (torch.exp(train_logp.float() - behaviour.to(train_logp.device)) - 1).abs()
            rows[name] = {
                **flags,
                "logprob_err_mean": float(err.mean()),
                "logprob_err_max": float(err.max()),
                "ratio_err_max": float(off.max()),
                "frac_ratio_off_2pct": float((off > 0.02).float().mean()),
                "frac_clipped": float((off > clip).float().mean()),
            }
        except Exception as exc:  # noqa: BLE001 - a setting that fails is a figure (the issue's fp16 crash)
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            log(f"precision {name}: {rows.get(name)}")
            trainer.policy.train()
    return rows


# What each trainer config sets; amp_2x trains micro-batches of twice the chunks.
TRAIN_CONFIGS = {
    "fp32": (dict(amp=False, tf32=False), 1),
    "tf32": (dict(amp=False, tf32=True), 1),
    "amp": (dict(amp=True, tf32=False), 1),
    # float16 with its GradScaler (and fused AdamW on CUDA): before amp_2x, which the part's budget may skip.
    "amp_fp16": (dict(amp=True, tf32=False, amp_dtype="float16"), 1),
    "amp_2x": (dict(amp=True, tf32=False), 2),
}


def train_config_row(
    trainer: Any, chunks: list[list[dict]], *, setting: dict, micro: int, iterations: int, device: torch.device
) -> dict:
    """One warm-up and ``iterations`` timed iterations of fetch-side assembly, ``estimate`` and ``train``
    (``iterations=0``: the warm-up alone is reported, a smoke run's figures)."""
    from mineonline_core.contracts import fragment as F
    from mineonline_core.trainer.batch import assemble_chunks

    train_config = trainer.train_config
    flags = {"use_amp": setting["amp"], **_flags(set_precision(trainer, **setting))}
    batch_size = train_config.batch_size_per_gpu
    train_config.batch_size_per_gpu = batch_size * micro
    skipped = trainer.update_guard.skipped_total
    rows = []
    try:
        for k in range(iterations + 1):
            trainer.iteration += 1
            trainer.learning_rate = trainer.learning_rate_at(trainer.iteration)
            batch = assemble_chunks(chunks, device=device)  # what the fetch thread hands the loop
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync(device)
            t0 = time.perf_counter()
            batch = trainer.algorithm.estimate(batch=batch)
            sync(device)
            t1 = time.perf_counter()
            estimate_peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            metrics = trainer.train(batch)
            sync(device)
            t2 = time.perf_counter()
            train_peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            frames = int(batch[F.REWARD].numel()) * train_config.epochs_per_iteration
            rows.append(
                {
                    "estimate_s": t1 - t0,
                    "train_s": t2 - t1,
                    "frames": frames,
                    "estimate_peak_gpu_mib": estimate_peak,
                    "train_peak_gpu_mib": train_peak,
                    "kl_ref": metrics.get("trainer/kl_ref"),
                    "clipfrac": metrics.get("trainer/clipfrac"),
                }
            )
            del batch
    finally:
        train_config.batch_size_per_gpu = batch_size
    timed = rows[1:] or rows  # the first pays allocation and kernel selection
    train_s = statistics.mean(r["train_s"] for r in timed)
    estimate_s = statistics.mean(r["estimate_s"] for r in timed)
    frames = timed[0]["frames"]
    peaks = [r[k] for r in rows for k in ("estimate_peak_gpu_mib", "train_peak_gpu_mib") if r[k] is not None]
    return {
        **flags,
        "batch_size_per_gpu": batch_size * micro,
        "frames_per_iteration": frames,
        "timed_iterations": len(timed),
        "trained_frames_per_s": frames / train_s,
        "frames_per_s_with_estimate": frames / (train_s + estimate_s),
        "train_ms_per_iteration": 1e3 * train_s,
        "estimate_ms_per_iteration": 1e3 * estimate_s,
        "peak_gpu_mib": max(peaks) if peaks else None,
        "estimate_peak_gpu_mib": max((r["estimate_peak_gpu_mib"] or 0) for r in rows) if peaks else None,
        "skipped_updates": trainer.update_guard.skipped_total - skipped,
        "first_clipfrac": rows[0]["clipfrac"],
        "kl_ref_last": rows[-1]["kl_ref"],
    }


# -- the run part's figures, from its metrics.jsonl and nvidia-smi's samples --------------------------------


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_figures(records: list[dict], t_start: float) -> dict:
    """The issue's rows from a run's ``metrics.jsonl`` records (``time`` is wall time)."""
    iters = [r for r in records if r.get("trainer/iteration") is not None]
    out: dict[str, Any] = {"iterations": len(iters)}
    # The start-up's parts, also when the cap ends the run before its first iteration: the command to the
    # logging actor's first record, then to the first env steps reported (the first iteration follows once
    # an iteration's chunks are collected and trained).
    if records:
        out["first_record_s"] = min(r["time"] for r in records) - t_start
    stepped = [r["time"] for r in records if r.get("step", 0) > 0]
    if stepped:
        out["first_env_steps_s"] = min(stepped) - t_start
    if not iters:
        return out
    first, last = iters[0], iters[-1]
    later = iters[1:] or iters
    out["first_iteration_s"] = first["time"] - t_start
    end = max(records, key=lambda r: r["time"])
    out["rollout_env_frames_per_s_whole_run"] = max(r.get("step", 0) for r in records) / max(
        end["time"] - t_start, 1e-9
    )
    out["samples_per_s_median"] = _median([r.get("trainer/samples_per_s") for r in later])
    if len(iters) > 1:
        span = last["time"] - first["time"]
        # Frames trained in an iteration: its samples/s x its train time (both logged with it).
        trained = sum(r["trainer/samples_per_s"] * r["perf/train_ms"] / 1e3 for r in later)
        out["trained_frames_per_wall_s_steady"] = trained / max(span, 1e-9)
        out["rollout_env_frames_per_s_steady"] = (last.get("step", 0) - first.get("step", 0)) / max(span, 1e-9)
        out["iteration_period_s_median"] = _median([b["time"] - a["time"] for a, b in zip(iters, iters[1:])])
    perf = sorted({k for r in iters for k in r if k.startswith("perf/")})
    out["trainer_perf_ms_median"] = {k: _median([r.get(k) for r in later]) for k in perf}
    # The manager's records carry the env-step rate, the workers' records their perf/ timers.
    keys = ("rollout/env_steps_per_s", "perf/inference_ms", "perf/inference_batch", "perf/env_step_ms")
    # The shared server's own figures: ms per forward and rows per forward (its requests coalesced).
    for key in (*keys, "perf/inference_server_ms", "rollout/inference_batch_mean"):
        out[key.replace("perf/", "rollout_").replace("rollout/", "rollout_") + "_median"] = _median(
            [r.get(key) for r in records]
        )
    return out


def gpu_figures(path: Path) -> dict | None:
    util, mem = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            u, m = (float(x) for x in line.split(",")[-2:])
        except ValueError:
            continue
        util.append(u)
        mem.append(m)
    if not util:
        return None
    busy = util[len(util) // 3 :]  # past start-up
    return {
        "samples": len(util),
        "util_mean_pct": statistics.mean(util),
        "util_mean_last_two_thirds_pct": statistics.mean(busy),
        "memory_used_max_mib": max(mem),
    }
