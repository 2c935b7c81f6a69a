"""``rollout_config``: rollout workers, their envs, the replay buffer and episode statistics."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mineonline_core.config._fields import OpenSection, Section, setting


class WorkerConfig(Section):
    """``rollout_config.worker_config``: what each rollout worker runs."""

    num_envs: int = setting(2, "Env processes each rollout worker steps in parallel (MineStudio example: 2-16).", ge=1)
    batch_size: int = setting(
        1,
        "Envs whose observations are stacked into one policy forward pass inside a worker; must not exceed num_envs.",
        ge=1,
    )
    restart_interval: float = setting(
        0.0,
        "Seconds after which a rollout worker rebuilds its envs, to shed leaks of long-lived "
        "simulators (MineStudio example: 3600). 0 disables restarts.",
        ge=0,
    )
    video_fps: int = setting(20, "Frames per second of recorded episode videos.", ge=1)
    video_output_dir: str = Field(
        "videos",
        description="Directory for recorded videos; relative paths are under the run directory.",
    )
    step_timeout: float = setting(
        60.0,
        "Seconds one env step or reset may take before the env is declared hung, closed as truncated and rebuilt.",
        gt=0,
    )
    max_env_restarts: int = setting(
        100,
        "Failures in a row of one env (crashes, hangs, non-finite answers; a successful step "
        "ends the row) before the run fails.",
        ge=0,
    )
    max_env_rebuilds: int = setting(
        200,
        "Env rebuilds (after crashes or hangs, all envs of one worker together) tolerated "
        "within rollout_config.restart_window seconds before the run fails.",
        ge=0,
    )
    video_upscale: int | None = setting(
        None,
        "Integer factor by which recorded frames are enlarged (nearest neighbour, so pixel art stays "
        "sharp); null picks the smallest factor that makes the short side at least 256 px.",
        ge=1,
    )
    env_processes: bool = Field(
        True,
        description="Step each env in its own process (a crash or hang is isolated, detected and "
        "rebuilt; envs step in parallel). false steps the envs in the worker's own thread: faster "
        "for envs whose step takes microseconds (CartPole), but a hang cannot be detected and a "
        "native crash restarts the whole worker.",
    )


class DatabaseConfig(OpenSection):
    """``replay_buffer_config.database_config``: the fragment store behind the replay buffer.

    Keys other than these belong to the selected backend and are checked against its own
    ``Config`` when the store is built.
    """

    backend: str = Field(
        "lmdb",
        description="Name of the registered fragment store that holds fragment payloads "
        "('lmdb' from mineonline-lmdb-buffer, 'memory' built in). Other keys of this section "
        "are passed to that store.",
    )
    path: str = Field(
        "replay_buffer",
        description="Directory of the on-disk store; relative paths are under the run directory.",
    )
    num_shards: int = setting(8, "Independent shards the store spreads fragments over.", ge=1)


class ReplayBufferConfig(Section):
    """``rollout_config.replay_buffer_config``: chunk bookkeeping, reuse and staleness."""

    max_chunks: int = setting(
        4800,
        "Chunks the buffer holds at most; the oldest are evicted first. Must hold at least one "
        "iteration's worth of chunks.",
        ge=1,
    )
    max_reuse: int = setting(2, "Times one chunk may be sampled for training before it is dropped.", ge=1)
    max_staleness: int = setting(
        2,
        "Largest model-version gap (the version a chunk is trained at minus the oldest version "
        "that produced its steps) at which a chunk may still be sampled; the trainer's fetch-ahead "
        "is held to it too. 0 samples only on-policy data.",
        ge=0,
    )
    fragments_per_report: int = setting(40, "Fragments the buffer receives between two of its metric reports.", ge=1)
    fragments_per_chunk: int = setting(
        1, "Consecutive fragments of one env stream grouped into a chunk, sampled together.", ge=1
    )
    database_config: DatabaseConfig = Field(
        default_factory=DatabaseConfig, description="The fragment store (see its keys)."
    )


class EpisodeStatisticsConfig(Section):
    """``rollout_config.episode_statistics_config``: the statistics actor; ``{}`` is fine."""

    window: int = setting(100, "Most recent finished episodes over which episode/* moving averages are taken.", ge=1)


class RolloutConfig(Section):
    """``rollout_config``: how experience is collected."""

    num_rollout_workers: int = setting(
        1, "Rollout worker actors, each with its own envs (MineStudio example: 2).", ge=1
    )
    num_gpus_per_worker: float = setting(
        0.0,
        "GPUs reserved for each rollout worker's policy inference; fractions share a GPU "
        "(MineStudio example: 1.0). 0 runs inference on CPU.",
        ge=0,
    )
    num_cpus_per_worker: float = setting(1.0, "CPUs reserved for each rollout worker actor; fractions allowed.", gt=0)
    inference: Literal["auto", "local", "shared"] = Field(
        "auto",
        description="Where the rollout policy runs. 'local': each rollout worker runs its own envs' "
        "batches (on its GPU share when num_gpus_per_worker > 0). 'shared': one inference server "
        "actor per run batches the requests of every worker into one forward and keeps every env's "
        "recurrent states on its device (requests carry observations, replies actions, values and, at a "
        "fragment's first step only, states), on a GPU when num_gpus_per_worker > 0 (it then reserves "
        "num_rollout_workers x num_gpus_per_worker, at most 1, and the workers none) or on the CPU "
        "otherwise, reserving num_cpus_per_worker CPUs more; envs still step in the workers. 'auto' "
        "(resolved when the config is loaded) is 'shared' when two or more workers have fractional GPU "
        "shares that together fit one GPU (one process owns that GPU's rollout inference instead of one "
        "CUDA context per worker time-slicing it), and 'local' otherwise (CPU runs, a GPU per worker, or "
        "shares over several GPUs, which one server would not cover).",
    )
    inference_wait_ms: float = setting(
        2.0,
        "With inference: shared, how long the free inference server waits for the requests of "
        "workers it has served before but are not yet queued, before it runs what is queued "
        "(without it, workers served together come back together and a free server runs "
        "alternating halves of them). 0 runs whatever is queued at once.",
        ge=0,
    )
    fragment_length: int = setting(
        256, "Env steps in one fragment, the unit a worker sends to the replay buffer.", ge=1
    )
    to_send_queue_size: int = setting(
        1,
        "Finished fragments a worker may queue before collection blocks (the fragments finished "
        "in one step are queued together); the sender writes everything queued in one store write "
        "and one buffer call. Raise it when workers wait on the buffer.",
        ge=1,
    )
    max_worker_restarts: int = setting(
        10,
        "Restarts of rollout workers (all together; Ray restarts a dead worker) tolerated within "
        "restart_window seconds before the run fails with each worker's last error, like RLlib's "
        "max_num_env_runner_restarts.",
        ge=0,
    )
    restart_window: float = setting(
        600.0,
        "Seconds over which max_worker_restarts and worker_config.max_env_rebuilds are counted.",
        gt=0,
    )
    worker_config: WorkerConfig = Field(default_factory=WorkerConfig, description="Per-worker env settings.")
    replay_buffer_config: ReplayBufferConfig = Field(
        default_factory=ReplayBufferConfig, description="Replay buffer settings."
    )
    episode_statistics_config: EpisodeStatisticsConfig = Field(
        default_factory=EpisodeStatisticsConfig, description="Episode statistics settings."
    )

    @model_validator(mode="after")
    def _resolve_inference(self) -> RolloutConfig:
        if self.inference == "auto":
            gpus = self.num_gpus_per_worker
            one_gpu = self.num_rollout_workers > 1 and 0 < gpus < 1 and self.num_rollout_workers * gpus <= 1
            self.inference = "shared" if one_gpu else "local"
        return self
