"""``examples/minestudio_cow.py`` unchanged, on the fake Minecraft engine (``mineonline_core.testing.minecraft``).

MineStudio's real ``MinecraftSim`` and its callbacks run the cow task; only the Java game is replaced, so
the flagship config runs on any machine. Point ``VPT_MODEL``/``VPT_WEIGHTS`` at small random VPT files
(the shared fixture ``vpt_public/public.model``/``public.weights``), shorten episodes with
``COW_TIME_LIMIT`` and shrink the run with ``SMALL`` on the command line; ``bench_minestudio.py`` and
``tests/test_minestudio_e2e.py`` do both.
"""

import importlib.util
import os
from pathlib import Path

from mineonline_core.testing.minecraft import with_fake_engine

_spec = importlib.util.spec_from_file_location(
    "minestudio_cow", Path(__file__).resolve().parents[1] / "examples" / "minestudio_cow.py"
)
_cow = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cow)

# JudgeResetCallback's 600 steps scaled down, so that a short run ends episodes (returns, achievements, videos).
TIME_LIMIT = int(os.environ.get("COW_TIME_LIMIT", "600"))


def env_generator():
    sim = with_fake_engine(_cow.env_generator)()
    for callback in sim.callbacks:
        if type(callback).__name__ == "JudgeResetCallback":
            callback.time_limit = TIME_LIMIT
    return sim


def policy_generator():
    # Defined here, not re-exported: the example is loaded by file under a name no import finds, and a run's
    # checkpoints must name their generators by import path.
    return _cow.policy_generator()


online_dict = _cow.online_dict

# A run that fits a 2-core machine in a few minutes: the example's values scaled down, the same keys.
SMALL = [
    "detach_rollout_manager=false",
    "rollout_config.num_rollout_workers=1",
    "rollout_config.num_gpus_per_worker=0",
    "rollout_config.fragment_length=32",
    "rollout_config.worker_config.num_envs=2",
    "rollout_config.worker_config.batch_size=2",
    "rollout_config.replay_buffer_config.database_config.num_shards=1",
    "train_config.num_workers=1",
    "train_config.num_gpus_per_worker=0",
    "train_config.batches_per_iteration=2",
    "train_config.gradient_accumulation=1",
    "train_config.context_length=32",
    "train_config.num_readers=1",
    "train_config.save_interval=1",
    "train_config.keep_interval=2",
    "train_config.record_video_interval=1",
    "logger_config.loggers=[]",
]
