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
    python benchmarks/bench_gpu.py --parts inprocess,run --run-iterations 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
from mineonline_core.trainer.device import indexed_device  # noqa: E402

from _gpusource import source_line  # noqa: E402

# The in-process pieces (the trainer, version-0 chunks, the precision and trainer-config rows) and the
# one JSON line each part prints live in _gpulib.py, beside this script.
from _gpulib import (  # noqa: E402
    CONFIG,
    PRECISION_CHUNKS,
    QUICK_OVERRIDES,
    TRAIN_CONFIGS,
    build_trainer,
    emit,
    gpu_figures,
    log,
    make_chunks,
    precision_rows,
    run_figures,
    set_precision,
    train_config_row,
)

PARTS = ("machine", "inprocess", "network", "run", "run_bf16", "run_fp16")  # inprocess: precision and trainer lines
# The whole device call fits 8 minutes: bench_gpu.sh's wheel install (~15 s) and this parent's start-up
# (~5 s), then each part under its own cap, in its own process. On an H200 the machine part took ~5 s,
# inprocess ~100, network ~30, and a run's first iteration 52-61 s, then 5-15 s an iteration: two runs fit,
# not three, so run_fp16 runs only when named (the inprocess part's amp_fp16 row covers its GradScaler).
# The default parts' caps sum to BUDGET_S at most, so no part can eat a later one's time.
CAPS = {"machine": 10, "inprocess": 115, "network": 40, "run": 135, "run_bf16": 135, "run_fp16": 135}
DEFAULT_PARTS = tuple(p for p in PARTS if p != "run_fp16")
BUDGET_S = 440.0
assert sum(CAPS[p] for p in DEFAULT_PARTS) <= BUDGET_S <= 480 - 30
QUICK_CAPS = {"machine": 60, "inprocess": 240, "run": 240}  # generous, for a loaded CI machine
RUN_GRACE_S = {"run": 40, "run_bf16": 25, "run_fp16": 25}  # after SIGTERM: the iteration ends, checkpoint, stop
# The use_amp rows of the end-to-end run: the same run, autocast to bfloat16 / float16 (with its GradScaler).
AMP_RUNS = {
    "run": [],
    "run_bf16": ["train_config.use_amp=true", "train_config.amp_dtype=bfloat16"],
    "run_fp16": ["train_config.use_amp=true", "train_config.amp_dtype=float16"],
}
AMP_RUN_ITERATIONS = 5
# Parts the orchestration test selects by name (never run by default): one crashes, one hangs.
SELFTEST_PARTS = ("selftest_crash", "selftest_hang")


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
    device = indexed_device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = QUICK_OVERRIDES if args.quick else []
    base: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    start = time.perf_counter()
    trainer = build_trainer(overrides, tempfile.mkdtemp(prefix="bench_gpu_"), device)
    rollout_config, train_config = trainer.config.rollout_config, trainer.train_config
    base["build_s"] = time.perf_counter() - start
    log(f"trainer built in {base['build_s']:.1f} s on {device}")
    base["params"] = sum(p.numel() for p in trainer.policy.parameters())
    base["reference"] = trainer.reference is not None
    n_chunks = train_config.batches_per_iteration * train_config.batch_size_per_gpu
    fpc = rollout_config.replay_buffer_config.fragments_per_chunk
    hw = trainer.policy.net.img_shape[0]
    start = time.perf_counter()
    set_precision(trainer, amp=False, tf32=False)  # the flagship's rollout numerics (use_amp: false)
    chunks, raw = make_chunks(
        trainer.policy,
        n_chunks=n_chunks,
        fragments_per_chunk=fpc,
        fragment_length=rollout_config.fragment_length,
        hw=hw,
        device=device,
    )
    base["make_chunks_s"] = time.perf_counter() - start
    log(f"{n_chunks} version-0 chunks made in {base['make_chunks_s']:.1f} s")
    base["chunks"], base["steps_per_chunk"] = n_chunks, fpc * rollout_config.fragment_length
    # Precision first: it needs the version-0 weights the chunks were collected with.
    settings = precision_rows(trainer, chunks, raw, device)
    emit("precision", {**base, "chunks": min(PRECISION_CHUNKS, n_chunks), "settings": settings}, args.quick)
    del raw

    def row(name: str) -> dict:
        setting, micro = TRAIN_CONFIGS[name]
        try:
            return train_config_row(
                trainer, chunks, setting=setting, micro=micro, iterations=0 if args.quick else 2, device=device
            )
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()

    configs = rows_within(list(TRAIN_CONFIGS), row, deadline=args.deadline)
    emit("trainer", {**base, "configs": configs}, args.quick)


def rows_within(
    names: list[str], row: Any, *, deadline: float, clock: Any = time.monotonic
) -> dict[str, dict[str, Any]]:
    """``row(name)`` for each name, skipping a row that would end past ``deadline`` if it took as long as
    the row before it: the part prints its line after the last row, so one row cut by the part's cap
    would lose every row already measured."""
    rows: dict[str, dict[str, Any]] = {}
    previous = 0.0
    for name in names:
        start = clock()
        if start + previous > deadline:
            rows[name] = {
                "skipped": f"the part's budget is spent ({deadline - start:.0f} s left, {previous:.0f} s a row)"
            }
            continue
        try:
            rows[name] = row(name)
        except Exception as exc:  # noqa: BLE001 - use_amp crashing on CUDA is one of the issue's rows
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        previous = clock() - start
        log(f"trainer config {name}: {rows[name]}")
    return rows


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


def part_run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_run_"))
    iterations = args.run_iterations if args.part == "run" else min(args.run_iterations, AMP_RUN_ITERATIONS)
    overrides = [
        *(QUICK_OVERRIDES if args.quick else []),
        f"output_dir={work}",
        "run_name=flagship",
        f"train_config.num_iterations={iterations}",
        *AMP_RUNS[args.part],
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
    stop_at = args.deadline - RUN_GRACE_S[args.part]
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
    emit(args.part, out, args.quick)


# ---------------------------------------------------------------------------------------------
# the parent: one child per part, each capped by what is left
# ---------------------------------------------------------------------------------------------


def part_selftest(args: argparse.Namespace) -> None:
    if args.part == "selftest_crash":
        raise RuntimeError("selftest_crash: a part that crashes")
    time.sleep(3600)  # selftest_hang: a part past its cap


PART_FUNCS = {
    "machine": part_machine,
    "inprocess": part_inprocess,
    "network": part_network,
    **{name: part_run for name in AMP_RUNS},
    **{name: part_selftest for name in SELFTEST_PARTS},
}
# The network alone at 2x: minutes on a CPU, and no figure the issue asks of one; the use_amp runs: the
# fp32 run's code path, whose CPU smoke run is enough.
GPU_ONLY = ("network", "run_bf16", "run_fp16")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", "--smoke", action="store_true", help="tiny shapes on the CPU, GPU-only parts skipped"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help=f"stop by then (default {BUDGET_S:g}; --quick 540)"
    )
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument(
        "--run-iterations", type=int, default=None, help="iterations of the run part (default 12; --quick 2)"
    )
    parser.add_argument("--run-overrides", nargs="*", default=[], help="more key=value overrides of the run part")
    parser.add_argument("--out", help="also append the JSON lines to this file")
    parser.add_argument("--cap", action="append", default=[], metavar="PART=S", help="a part's cap in seconds")
    parser.add_argument("--wheels", default=os.environ.get("GPU_WHL", ".gpu/whl"), help="the carried wheels' folder")
    parser.add_argument("--part", choices=[*PARTS, *SELFTEST_PARTS], help=argparse.SUPPRESS)  # a child: this part
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's time.monotonic() budget
    args = parser.parse_args(argv)
    args.run_iterations = args.run_iterations or (2 if args.quick else 12)
    if args.part:
        PART_FUNCS[args.part](args)
        return
    budget = args.budget_s or (540.0 if args.quick else BUDGET_S)
    caps = {**(QUICK_CAPS if args.quick else CAPS), **{p: 10.0 for p in SELFTEST_PARTS}}
    for item in args.cap:
        name, _, seconds = item.partition("=")
        caps[name] = float(seconds)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS) - set(SELFTEST_PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; the parts are {', '.join(PARTS)}")
    source = source_line(wheels=Path(args.wheels), root=bl.ROOT, quick=args.quick)
    _print(source, args.out)
    if not json.loads(source)["ok"]:
        # Minutes of a lent GPU spent on code that is not the checkout's would measure nothing asked for.
        print("bench_gpu.py: the installed project is not this checkout; rebuild the wheels", file=sys.stderr)
        sys.exit(3)
    for part in parts:
        left = budget - (time.monotonic() - start)
        cap = min(caps.get(part, 0), left - 5)
        if part in GPU_ONLY and (args.quick or not cuda):
            reason = "no CUDA" if not cuda else "--quick (it measures the 2x network only)"
            lines = [json.dumps({"bench": "gpu", "part": part, "quick": args.quick, "skipped": reason})]
        elif cap < 5:
            lines = [
                json.dumps({"bench": "gpu", "part": part, "quick": args.quick, "skipped": f"budget: {left:.0f} s left"})
            ]
        else:
            lines = run_child(part, cap, args)
        for line in lines:
            _print(line, args.out)


def _print(line: str, out: str | None) -> None:
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
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
