"""The flagship on one GPU (issue 24): every row of the issue's table, in one call that stops itself.

The workload is ``examples/flagship_vpt2x.yaml`` (VPT-2x architecture, KL-PPO with MineStudio's
settings, Crafter at 128x128, 4 rollout workers x 8 envs, 4 x 8 chunks of 128 steps an iteration).
Each part runs in a child process (a crash or a hung CUDA call costs that part alone, and each part
starts with the GPU to itself) under a cap taken from what is left of ``--budget-s``; each prints ONE
JSON line ``{"bench": "gpu", "part": ...}``, or the parent prints one with the part's ``error``:

* ``machine``: torch, CUDA, the GPU, the commit measured;
* ``trainer``: the project's ``PPOTrainer`` built from the flagship config in this process
  (``resolve`` + ``setup_rank(local=True, device=...)``, on the GPU), ``estimate`` (the GAE pass) and
  ``train`` on version-0 chunks per precision (``config/precision.py``'s decision): ``fp32`` (TF32
  off, the project's default), ``tf32`` (``allow_tf32: true``), ``amp`` (``use_amp: true``, bf16)
  and ``amp_2x`` (the same with micro-batches of twice the chunks); trained frames/s, estimate ms per
  iteration, peak GPU memory of each;
* ``precision`` (DESIGN §5.3): on version-0 data, the log-probs training computes (``estimate``'s
  pass, ``current_policy_outputs``, under the trainer's ``autocast()``) against the behaviour
  log-probs rollout computes one step at a time in its own numerics: mean and max error, max
  ``|ratio - 1|``, the fraction of steps off by more than 2 % and of steps PPO would clip, per
  setting (the project's fp32, fp32 with TF32 and amp; and, as before the precision policy,
  PyTorch's default TF32 switches and bf16 training against fp32 rollout);
* ``network``: ``bench_vpt.py --model foundation-model-2x`` fp32 and bf16 (the network alone:
  forward + backward of 8 x 64 frames, and rollout inference of a batch of 8);
* ``run``: ``mineonline run examples/flagship_vpt2x.yaml`` as a user runs it: command to the first
  finished iteration, trained frames per second of wall (steady: first to last iteration),
  ``trainer/samples_per_s``, rollout env frames/s, ``perf/inference_ms`` per batch, broadcast and GAE
  ms per iteration, GPU utilisation and memory (``nvidia-smi`` every second).

Version-0 chunks are made rollout's way (one step at a time, batch = chunks, recurrent state carried,
fp32) over random frames with synthetic episode ends: throughput and numerics do not depend on what
the frames show, and stepping 32 Crafter envs would cost the budget's seconds.

    bash benchmarks/bench_gpu.sh                            # on a lent GPU (benchmarks/RESULTS.md, issue 24)
    python benchmarks/bench_gpu.py --quick                  # smoke: tiny shapes, the network part skipped
    python benchmarks/bench_gpu.py --parts trainer,precision --run-iterations 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _benchlib as bl  # noqa: E402
import torch  # noqa: E402

# The in-process pieces (the trainer, version-0 chunks, the precision and trainer-config rows) and the
# one JSON line each part prints live in _gpulib.py, beside this script.
from _gpulib import (  # noqa: E402
    CONFIG,
    PRECISION_CHUNKS,
    QUICK_OVERRIDES,
    TRAIN_CONFIGS,
    build_trainer,
    emit,
    log,
    make_chunks,
    precision_rows,
    set_precision,
    train_config_row,
)

PARTS = ("machine", "inprocess", "network", "run")  # inprocess prints the precision and trainer lines
# Caps in seconds (what a part may take, not what it takes: on an H200 the machine part takes ~5 s,
# inprocess ~95, network ~50, so the run gets ~240 s). --quick: generous, for a loaded CI machine.
CAPS = {"machine": 30, "inprocess": 150, "network": 80, "run": 400}
QUICK_CAPS = {"machine": 60, "inprocess": 240, "run": 240}
RUN_GRACE_S = 40  # after SIGTERM the trainer finishes its iteration, checkpoints and stops the actors


# ---------------------------------------------------------------------------------------------
# machine
# ---------------------------------------------------------------------------------------------


def part_machine(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "bf16_supported": torch.cuda.is_bf16_supported(),
        }
    git = subprocess.run(["git", "-C", str(bl.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    out["commit"] = git.stdout.strip() or None  # the device's copy of the tree may have no .git
    import mineonline_core

    out["mineonline_core"] = str(Path(mineonline_core.__file__).parent)
    emit("machine", out, args.quick)


# ---------------------------------------------------------------------------------------------
# inprocess: PPOTrainer.train / estimate and the precision of its log-probs
# ---------------------------------------------------------------------------------------------


def part_inprocess(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = QUICK_OVERRIDES if args.quick else []
    base: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    start = time.perf_counter()
    trainer = build_trainer(overrides, tempfile.mkdtemp(prefix="bench_gpu_"), device)
    rc, tc = trainer.config.rollout_config, trainer.train_config
    base["build_s"] = time.perf_counter() - start
    log(f"trainer built in {base['build_s']:.1f} s on {device}")
    base["params"] = sum(p.numel() for p in trainer.policy.parameters())
    base["reference"] = trainer.reference is not None
    n_chunks = tc.batches_per_iteration * tc.batch_size_per_gpu
    fpc = rc.replay_buffer_config.fragments_per_chunk
    hw = trainer.policy.net.img_shape[0]
    start = time.perf_counter()
    set_precision(trainer, amp=False, tf32=False)  # the flagship's rollout numerics (use_amp: false)
    chunks, raw = make_chunks(
        trainer.policy,
        n_chunks=n_chunks,
        fragments_per_chunk=fpc,
        fragment_length=rc.fragment_length,
        hw=hw,
        device=device,
    )
    base["make_chunks_s"] = time.perf_counter() - start
    log(f"{n_chunks} version-0 chunks made in {base['make_chunks_s']:.1f} s")
    base["chunks"], base["steps_per_chunk"] = n_chunks, fpc * rc.fragment_length
    # Precision first: it needs the version-0 weights the chunks were collected with.
    settings = precision_rows(trainer, chunks, raw, device)
    emit("precision", {**base, "chunks": min(PRECISION_CHUNKS, n_chunks), "settings": settings}, args.quick)
    del raw
    configs = {}
    for name, (setting, micro) in TRAIN_CONFIGS.items():
        if time.monotonic() > args.deadline:
            configs[name] = {"skipped": "the part's budget is spent"}
            continue
        try:
            configs[name] = train_config_row(
                trainer, chunks, setting=setting, micro=micro, iterations=0 if args.quick else 2, device=device
            )
        except Exception as exc:  # noqa: BLE001 - use_amp crashing on CUDA is one of the issue's rows
            configs[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        log(f"trainer config {name}: {configs[name]}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    emit("trainer", {**base, "configs": configs}, args.quick)


# ---------------------------------------------------------------------------------------------
# network: bench_vpt.py at 2x, fp32 and bf16
# ---------------------------------------------------------------------------------------------


def part_network(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    for label, extra in (("fp32", []), ("bf16", ["--amp"])):
        left = args.deadline - time.monotonic()
        if left < 10:
            out[label] = {"skipped": "the part's budget is spent"}
            continue
        cmd = [
            sys.executable,
            str(HERE / "bench_vpt.py"),
            "--model",
            "foundation-model-2x",
            "--train-batches",
            "8",
            "--repeats",
            "5",
            "--rollout-steps",
            "100",
            *extra,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left / (2 if label == "fp32" else 1))
            line = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if proc.returncode or not line:
                out[label] = {"error": f"rc {proc.returncode}: {proc.stderr[-800:]}"}
                continue
            r = json.loads(line[-1])
            out[label] = {
                "train_frames_per_s": r["train"][0]["frames_per_s"],
                "train_batch": r["train"][0]["batch"],
                "train_T": r["train"][0]["T"],
                "inference_ms_batch8": 1e3 * r["rollout"]["s_per_call"],
                "inference_frames_per_s": r["rollout"]["frames_per_s"],
                "peak_gpu_mib": r.get("peak_gpu_mib"),
            }
        except subprocess.TimeoutExpired:
            out[label] = {"error": "timed out"}
    emit("network", out, args.quick)


# ---------------------------------------------------------------------------------------------
# run: the whole loop as a user runs it
# ---------------------------------------------------------------------------------------------


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_figures(records: list[dict], t_start: float) -> dict:
    """The issue's rows from a run's ``metrics.jsonl`` records (``time`` is wall time)."""
    iters = [r for r in records if r.get("trainer/iteration") is not None]
    out: dict[str, Any] = {"iterations": len(iters)}
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
    for key in ("rollout/env_steps_per_s", "perf/inference_ms", "perf/inference_batch", "perf/env_step_ms"):
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


def part_run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_run_"))
    overrides = [
        *(QUICK_OVERRIDES if args.quick else []),
        f"output_dir={work}",
        "run_name=flagship",
        f"train_config.num_iterations={args.run_iterations}",
        *args.run_overrides,
    ]
    smi = None
    smi_path = work / "smi.csv"
    if torch.cuda.is_available():
        with smi_path.open("w") as f:
            smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-l", "1"],
                stdout=f,
                stderr=subprocess.DEVNULL,
            )
    cmd = [sys.executable, "-m", "mineonline_core.cli", "run", str(CONFIG), *overrides, "--no-progress"]
    t_start = time.time()
    with (work / "console.log").open("w") as console:
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, cwd=work)
    stop_at = args.deadline - RUN_GRACE_S
    out: dict[str, Any] = {"overrides": overrides, "stopped_early": False}
    try:
        proc.wait(timeout=max(stop_at - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        # Ctrl-C for mineonline (to the driver alone): the trainer ends its iteration, checkpoints, the actors stop.
        out["stopped_early"] = True
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=max(args.deadline - time.monotonic() - 5, 1))
        except subprocess.TimeoutExpired:
            proc.kill()  # the parent's cap then ends this process group: the Ray processes the driver started
            proc.wait()
    out["wall_s"], out["rc"] = time.time() - t_start, proc.returncode
    if smi is not None:
        smi.terminate()
        smi.wait()
    out["gpu"] = gpu_figures(smi_path) if smi is not None else "skipped: no CUDA"
    records = []
    metrics = work / "flagship" / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the stop
    out.update(run_figures(records, t_start))
    if not out["iterations"]:
        out["console_tail"] = (work / "console.log").read_text(errors="replace").splitlines()[-30:]
    emit("run", out, args.quick)


# ---------------------------------------------------------------------------------------------
# the parent: one child per part, each capped by what is left
# ---------------------------------------------------------------------------------------------

PART_FUNCS = {"machine": part_machine, "inprocess": part_inprocess, "network": part_network, "run": part_run}
GPU_ONLY = ("network",)  # the network alone at 2x: minutes on a CPU, and no figure the issue asks of one


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", "--smoke", action="store_true", help="tiny shapes on the CPU, GPU-only parts skipped"
    )
    parser.add_argument("--budget-s", type=float, default=None, help="stop by then (default 390; --quick 540)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument(
        "--run-iterations", type=int, default=None, help="iterations of the run part (default 12; --quick 2)"
    )
    parser.add_argument("--run-overrides", nargs="*", default=[], help="more key=value overrides of the run part")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child: run this part
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's time.monotonic() budget
    args = parser.parse_args(argv)
    args.run_iterations = args.run_iterations or (2 if args.quick else 12)
    if args.part:
        PART_FUNCS[args.part](args)
        return
    budget = args.budget_s or (540.0 if args.quick else 390.0)
    caps = QUICK_CAPS if args.quick else CAPS
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; the parts are {', '.join(PARTS)}")
    for part in parts:
        left = budget - (time.monotonic() - start)
        cap = min(caps.get(part, 0), left - 5)
        if part in GPU_ONLY and (args.quick or not cuda):
            reason = "no CUDA" if not cuda else "--quick (it measures the 2x network only)"
            lines = [json.dumps({"bench": "gpu", "part": part, "quick": args.quick, "skipped": reason})]
        elif cap < 10:
            lines = [
                json.dumps({"bench": "gpu", "part": part, "quick": args.quick, "skipped": f"budget: {left:.0f} s left"})
            ]
        else:
            lines = run_child(part, cap, args)
        for line in lines:
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


def run_child(part: str, cap: float, args: argparse.Namespace) -> list[str]:
    """Run one part in a child process for at most ``cap`` s; its JSON lines, or one with the error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--run-iterations", str(args.run_iterations)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--run-overrides", *args.run_overrides] if args.run_overrides else []
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # The child stops its own work by the deadline (time.monotonic() is system-wide on Linux), 5 s
    # before the cap ends it; in a session of its own, so that ending it ends what it started.
    proc = subprocess.Popen(
        [*cmd, "--deadline", repr(start + cap - 5)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=cap)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's own children too (a run's Ray processes)
        stdout, stderr = proc.communicate()
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what a part left behind (a killed driver's Ray processes)
    except ProcessLookupError:
        pass  # nothing was left: the usual case
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines or proc.returncode:
        lines.append(
            json.dumps(
                {
                    "bench": "gpu",
                    "part": part,
                    "quick": args.quick,
                    "rc": proc.returncode,
                    "error": "timed out" if timed_out else f"rc {proc.returncode}",
                    "seconds": round(time.monotonic() - start, 1),
                    "stderr_tail": stderr[-2000:],
                }
            )
        )
    return lines


if __name__ == "__main__":
    main()
