"""A trained policy outside training: ``load_policy`` for deployment, ``evaluate`` for ``mineonline eval``.

Both read only a checkpoint: its ``config.yaml`` (the resolved run config, generators by import
path) rebuilds the env and the policy with the installed plugins, and ``model.pt`` holds the
weights. No Ray, trainer, replay store or logger is started. A Python config module's generators
are imported from the file the config names, or, when that file is gone, from the copy of its text
the checkpoint keeps (``source_config.txt``)::

    policy = mineonline_core.load_policy("runs/demo")        # run dir, save dir or checkpoint dir
    env = policy.make_env()
    obs, _ = env.reset()
    action, state = policy.act(obs)                          # state=None starts an episode
    obs, reward, terminated, truncated, info = env.step(action)
    action, state = policy.act(obs, state)
    actions, states = policy.predict(batch_of_raw_observations, states, episode_start=starts)  # as SB3's
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import yaml

from mineonline_core.config import OnlineConfig, load_config
from mineonline_core.config.generators import KEYS
from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.registry import PluginManager, get_plugin_manager
from mineonline_core.services.episodes import EVAL_SEED_OFFSET, LoadedPolicy, run_episode, summarize

EVAL_FILE = "eval.json"


def find_checkpoint(path: str | pathlib.Path) -> pathlib.Path:
    """The checkpoint ``path`` names: a checkpoint directory, or the newest under a run or save dir."""
    from mineonline_core.trainer import checkpoint as ckpt

    try:
        return ckpt.resolve_resume(path)
    except CheckpointError:
        raise CheckpointError(
            f"{str(path)!r} holds no complete checkpoint. Fix: give a run directory (runs/<run_name>), its "
            f"checkpoints/ directory or one checkpoint_NNNNNN directory in it."
        ) from None


def load_policy(
    path: str | pathlib.Path,
    *,
    overrides: Sequence[str] = (),
    device: str | torch.device = "cpu",
    pm: PluginManager | None = None,
) -> LoadedPolicy:
    """The policy of the checkpoint at ``path`` with its weights; ``overrides`` change its saved config."""
    from mineonline_core.driver.resolve import resolve_generators
    from mineonline_core.trainer import checkpoint as ckpt

    state = ckpt.load_checkpoint(find_checkpoint(path))
    where = state["path"]
    data = yaml.safe_load(state["config_yaml"])
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{str(where / 'config.yaml')!r} holds no config mapping; the checkpoint predates self-contained configs."
        )
    with tempfile.TemporaryDirectory(prefix="mineonline-eval-") as scratch:
        _use_saved_source(data, where, pathlib.Path(scratch))
        loaded = load_config(data, overrides)
        gens = resolve_generators(loaded, pm or get_plugin_manager(), probe=True)
        policy = gens.policy_generator()
    ckpt.check_compatible(policy, state["model"], source=str(where))
    policy.load_state_dict(state["model"])
    policy.to(device).eval()
    trainer = state["trainer"]
    return LoadedPolicy(
        policy=policy,
        config=loaded.config,
        checkpoint=where,
        iteration=int(trainer["iteration"]),
        version=int(trainer.get("version", 0)),
        env_generator=gens.env_generator,
    )


def _use_saved_source(data: dict, checkpoint: pathlib.Path, scratch: pathlib.Path) -> None:
    """Point generators whose config file is gone at the checkpoint's copy of that file."""
    source = checkpoint / "source_config.txt"
    for key in KEYS:
        spec = data.get(key)
        if not isinstance(spec, str):
            continue
        target, _, attr = spec.rpartition(":")
        if target.endswith(".py") and not pathlib.Path(target).exists() and source.is_file():
            copy = scratch / pathlib.Path(target).name
            copy.write_text(source.read_text())
            data[key] = f"{copy}:{attr}"


# ---------------------------------------------------------------------------------------------
# mineonline eval
# ---------------------------------------------------------------------------------------------


def default_output(checkpoint: pathlib.Path) -> pathlib.Path:
    """``<run_dir>/eval/<checkpoint's path under the save dir>`` when the checkpoint sits in a run
    directory (``eval/checkpoint_000020``, ``eval/best/checkpoint_000020``), else ``./eval/<name>``."""
    run_dir = next((d for d in checkpoint.resolve().parents if (d / "run.json").is_file()), None)
    if run_dir is None:
        return pathlib.Path.cwd() / "eval" / checkpoint.name
    under_save_dir = checkpoint.resolve().relative_to(run_dir).parts[1:]
    return run_dir.joinpath("eval", *under_save_dir)


def evaluate(
    path: str | pathlib.Path,
    *,
    episodes: int | None = None,
    video: bool = False,
    deterministic: bool | None = None,
    overrides: Sequence[str] = (),
    output: str | pathlib.Path | None = None,
    seed: int | None = None,
    progress: bool = True,
    pm: PluginManager | None = None,
) -> dict[str, Any]:
    """Run ``episodes`` episodes with the checkpoint's policy; write ``eval.json`` (and mp4s) and return it.

    Unset, ``episodes``, ``deterministic`` and ``seed`` are those of the run's evaluation while training
    (``eval_episodes``, ``eval_deterministic``, ``seed + EVAL_SEED_OFFSET``), so the best checkpoint
    scores here what ``best.json`` says. Episode ``i`` resets with ``seed + i``."""
    if episodes is not None and episodes < 1:
        raise ConfigError(f"--episodes {episodes}: evaluate at least one episode. Fix: --episodes 10.")
    policy = load_policy(path, overrides=overrides, pm=pm)
    train_config = policy.config.train_config
    episodes = train_config.eval_episodes if episodes is None else episodes
    deterministic = train_config.eval_deterministic if deterministic is None else deterministic
    seed = int(policy.config.seed) + EVAL_SEED_OFFSET if seed is None else seed
    out_dir = pathlib.Path(output) if output is not None else default_output(policy.checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    env = policy.make_env()
    records, started = [], time.perf_counter()
    bar = _Bar(episodes, enabled=progress)
    try:
        for i in range(episodes):
            episode = run_episode(policy, env, deterministic=deterministic, seed=seed + i, record=video)
            if video:
                episode["video"] = _write_video(policy.config, out_dir / f"episode_{i:03d}.mp4", *episode.pop("_video"))
            records.append(episode)
            bar.advance(f"episode {i + 1}/{episodes}: return {episode['return']:.2f}, length {episode['length']}")
    finally:
        bar.close()
        env.close()
    wall = time.perf_counter() - started
    result = {
        "checkpoint": str(policy.checkpoint),
        "iteration": policy.iteration,
        "model_version": policy.version,
        "deterministic": deterministic,
        "seed": seed,
        "overrides": list(overrides),
        **summarize(records),
        "env_steps_per_s": sum(e["length"] for e in records) / max(wall, 1e-9),
        "wall_s": wall,
        "per_episode": records,
    }
    (out_dir / EVAL_FILE).write_text(json.dumps(result, indent=1, default=_json_default))
    result["output"] = str(out_dir)
    return result


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write_video(config: OnlineConfig, path: pathlib.Path, frames: list, returns: list, values: list) -> str | None:
    from mineonline_core.services.video import encode_episode_video

    if not frames:
        print("eval: --video needs image observations (obs['image']); this env has none, so no video", file=sys.stderr)
        return None
    wc = config.rollout_config.worker_config
    path.write_bytes(
        encode_episode_video(frames, fps=wc.video_fps, returns=returns, values=values, upscale=wc.video_upscale)
    )
    return path.name


class _Bar:
    """A rich progress bar over episodes on a terminal; one line per episode otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.enabled, self._progress = enabled, None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            self._task = self._progress.add_task("eval", total=total)
            self._progress.start()

    def advance(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line)
            self._progress.advance(self._task)
        elif self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
