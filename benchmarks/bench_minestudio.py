"""The flagship path, timed as a user runs it: ``mineonline run`` of MineStudio's cow example on the real
``MinecraftSim`` over the fake engine (``benchmarks/minestudio_cow_fake.py``), with random VPT weights in
place of the released files. Prints ONE JSON line.

    PYTHONPATH=. python benchmarks/bench_minestudio.py                              # the small fixture model
    PYTHONPATH=. python benchmarks/bench_minestudio.py --model foundation-model-1x  # real 1x shapes
    PYTHONPATH=. python benchmarks/bench_minestudio.py --quick                      # one iteration

``--model`` other than ``fixture`` writes a ``.model`` file with that model's architecture (from
``shared/fixtures/vpt_manifest.json``) and a ``.weights`` file of random values whose keys and shapes are
checked against the manifest, so ``load_vpt_policy`` loads it strictly as it would the released file.

Reported: ``wall_s`` of the whole command (Ray start, env and policy builds, training, shutdown);
``env_steps_per_s`` (rollout, 2 envs at 128x128) and ``train_samples_per_s`` from the run's summary;
``peak_rss_mib`` per process role (driver, rollout worker, trainer rank, ...) and of all of them
together (``total``), sampled every 0.5 s over the process tree, which is killed past
``--max-total-rss-gib``; ``load_1m_before`` and ``load_1m`` (after) because the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURES = Path(os.environ.get("MINEONLINE_VPT_FIXTURES") or ROOT.parent / "shared" / "fixtures")
sys.path.insert(0, str(HERE))

from _benchlib import emit  # noqa: E402
from minestudio_cow_fake import SMALL  # noqa: E402


def write_random_model(model: str, out: Path) -> tuple[Path, Path]:
    """A VPT .model/.weights pair with ``model``'s real layout and random values."""
    import torch

    from mineonline_vpt import VPTPolicy

    entry = json.loads((FIXTURES / "vpt_manifest.json").read_text())["models"][model]
    torch.manual_seed(0)
    policy = VPTPolicy.from_vpt_kwargs(entry["policy_kwargs"], temperature=float(entry["pi_head_opts"]["temperature"]))
    state = policy.state_dict()
    layout = [(k, list(v.shape)) for k, v in state.items()]
    if layout != [(e["key"], e["shape"]) for e in entry["state_dict"]]:
        raise SystemExit(f"{model}: the random state dict does not have the released layout")
    model_path, weights_path = out / f"{model}.model", out / f"{model}.weights"
    with model_path.open("wb") as f:
        pickle.dump(
            {"model": {"args": {"net": {"args": entry["policy_kwargs"]}, "pi_head_opts": entry["pi_head_opts"]}}}, f
        )
    torch.save(state, weights_path)
    return model_path, weights_path


def _role(proc) -> str:
    try:
        name = " ".join(proc.cmdline()[:3])
    except Exception:  # noqa: BLE001 - the process ended meanwhile
        return "gone"
    for role in (
        "RolloutWorker",
        "RayTrainWorker",
        "TrainController",
        "RolloutManager",
        "ReplayBuffer",
        "EpisodeStatistics",
        "StoreHost",
        "LoggerHub",
        "raylet",
        "gcs_server",
        "mineonline_core.cli",
        "forkserver",
        "multiprocessing",
    ):
        if role in name:
            return role
    return name.split("/")[-1][:40] or "other"


def sample_rss(root_pid: int, stop: threading.Event, peaks: dict[str, float], limit_mib: float) -> None:
    """Peak RSS per role over the run's process tree; the whole tree (the processes this script
    started, by pid) is killed when together they pass ``limit_mib``, so a 2x run cannot take the
    shared machine down."""
    import psutil

    root = psutil.Process(root_pid)
    while not stop.wait(0.5):
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0.0
        for proc in procs:
            try:
                rss = proc.memory_info().rss / 2**20
            except psutil.Error:
                continue
            total += rss
            role = _role(proc)
            peaks[role] = max(peaks.get(role, 0.0), rss)
        peaks["total"] = max(peaks.get("total", 0.0), total)
        if total > limit_mib:
            peaks["killed_at_total"] = total
            for proc in reversed(procs):
                try:
                    proc.kill()
                except psutil.Error:
                    pass
            return


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="fixture", help="fixture, foundation-model-1x or foundation-model-2x")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--time-limit", type=int, default=30, help="JudgeResetCallback steps per episode")
    parser.add_argument("--quick", action="store_true", help="one iteration")
    parser.add_argument(
        "--max-total-rss-gib", type=float, default=12.0, help="kill the run past this much RSS, all processes together"
    )
    args = parser.parse_args(argv)
    iterations = 1 if args.quick else args.iterations
    with tempfile.TemporaryDirectory(prefix="bench_minestudio_") as tmp:
        tmp_path = Path(tmp)
        if args.model == "fixture":
            model_path, weights_path = (
                FIXTURES / "vpt_public" / "public.model",
                FIXTURES / "vpt_public" / "public.weights",
            )
        else:
            model_path, weights_path = write_random_model(args.model, tmp_path)
        env = {
            **os.environ,
            "VPT_MODEL": str(model_path),
            "VPT_WEIGHTS": str(weights_path),
            "COW_TIME_LIMIT": str(args.time_limit),
            "WANDB_MODE": "disabled",
        }
        command = [
            sys.executable,
            "-m",
            "mineonline_core.cli",
            "run",
            str(HERE / "minestudio_cow_fake.py"),
            *SMALL,
            f"train_config.num_iterations={iterations}",
            f"output_dir={tmp_path}",
            "run_name=cow",
            "--no-progress",
        ]
        load_before = os.getloadavg()[0]
        peaks: dict[str, float] = {}
        stop = threading.Event()
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = threading.Thread(
            target=sample_rss, args=(proc.pid, stop, peaks, args.max_total_rss_gib * 1024), daemon=True
        )
        sampler.start()
        output, _ = proc.communicate()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        result = {
            "model": args.model,
            "iterations": iterations,
            "wall_s": round(wall, 1),
            "returncode": proc.returncode,
            "load_1m_before": round(load_before, 1),
            "peak_rss_mib": {k: round(v) for k, v in sorted(peaks.items()) if k != "gone"},
        }
        summary_path = tmp_path / "cow" / "summary.json"
        if proc.returncode == 0 and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            result.update(
                env_steps=summary.get("rollout/env_steps"),
                env_steps_per_s=summary.get("rollout/env_steps_per_s"),
                train_samples_per_s=summary.get("trainer/samples_per_s"),
                episodes=summary.get("episode/count"),
                episode_return_mean=summary.get("episode/return_mean"),
                kl_ref=summary.get("trainer/kl_ref"),
                videos=len(list((tmp_path / "cow" / "videos").glob("*.mp4"))),
            )
        else:
            result["error"] = output[-2000:]
    return emit("minestudio_cow", result, quick=args.quick)


if __name__ == "__main__":
    main()
