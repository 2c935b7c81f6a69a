"""``train_config``: the optimisation side the core runs (Ray Train workers, the update loop,
checkpoints). The selected trainer's own keys (PPO's clip, coefficients, KL ...) sit in the same
section; they are the extra keys, validated against that trainer's ``Config`` (``driver/resolve.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mineonline_core.config._fields import OpenSection, setting


class TrainConfig(OpenSection):
    """``train_config``: how the policy is optimised, saved and resumed; other keys go to the selected
    trainer's ``Config``."""

    # --- distribution -------------------------------------------------------------------------
    num_workers: int = setting(1, "Ray Train workers running data-parallel training (MineStudio example: 2).", ge=1)
    num_gpus_per_worker: float = setting(
        0.0,
        "GPUs reserved for each train worker (MineStudio example: 1.0); 0 trains on CPU with gloo.",
        ge=0,
    )
    num_cpus_per_worker: float = setting(1.0, "CPUs reserved for each train worker.", gt=0)
    use_ray_train: bool | None = Field(
        None,
        description="Train on Ray Train ranks (true) or in the driver's own process (false). null: Ray "
        "Train when num_workers > 1, the driver otherwise, which starts training about 10 s sooner (no "
        "controller, placement group, worker group or process group). A GPU rank in the driver leases "
        "num_gpus_per_worker from Ray for the run (no rollout worker is placed on that share) and "
        "trains on that GPU; when the driver's process sees no CUDA device, null hands the rank to Ray "
        "Train (logged) and false is an error. Both run the same trainer code.",
    )
    # --- schedule -----------------------------------------------------------------------------
    num_iterations: int = setting(
        4000, "Training iterations to run (each: fetch, advantages, optimise, broadcast).", ge=1
    )
    learning_rate: float = setting(2e-5, "Initial learning rate of the AdamW optimiser.", gt=0)
    anneal_lr_linearly: bool = Field(False, description="Decay the learning rate linearly to 0 over num_iterations.")
    weight_decay: float = setting(0.04, "AdamW weight decay.", ge=0)
    adam_eps: float = setting(1e-8, "Adam epsilon added to the denominator.", gt=0)
    # --- batches ------------------------------------------------------------------------------
    batch_size_per_gpu: int = setting(1, "Chunks in one training batch on each train worker.", ge=1)
    batches_per_iteration: int = setting(
        10,
        "Batches each train worker processes per iteration (and epoch); a multiple of gradient_accumulation.",
        ge=1,
    )
    gradient_accumulation: int = setting(10, "Batches whose gradients are summed before one optimiser step.", ge=1)
    epochs_per_iteration: int = setting(1, "Passes over an iteration's fetched chunks.", ge=1)
    context_length: int = setting(
        64,
        "Time steps per forward/backward window when a chunk is split for training; at most "
        "fragment_length * fragments_per_chunk.",
        ge=1,
    )
    # --- returns and advantages ---------------------------------------------------------------
    discount: float = setting(0.999, "Discount factor gamma of future rewards.", gt=0, le=1)
    gae_lambda: float = setting(0.95, "GAE lambda: 0 is one-step TD, 1 is Monte Carlo.", ge=0, le=1)
    # --- optimiser steps ---------------------------------------------------------------------
    max_grad_norm: float = setting(5.0, "Global gradient L2 norm above which it is clipped.", gt=0)
    max_skipped_updates: int = setting(
        10,
        "Optimiser steps in a row whose loss or gradients hold a NaN or infinity (each one is "
        "skipped and counted in trainer/skipped_updates) before the run fails with what went "
        "non-finite and where.",
        ge=1,
    )
    use_normalized_vf: bool = Field(
        True,
        description="Train the value head on running-normalised returns: the core updates the "
        "head's normaliser with each iteration's returns (every rank) before the update loop.",
    )
    normalize_observations: bool = Field(
        False,
        description="Normalise the vector observation ('obs') per feature by its running mean and variance, "
        "clipped to +-10 (SB3's VecNormalize). The statistics are buffers of the policy (obs_normalizer): "
        "checkpointed, restored on resume, broadcast with the weights to every worker, applied identically "
        "by eval and load_policy. The trainer moves them after each iteration's update, from the steps of the "
        "chunks served for the first time, merged over every rank. An env without an 'obs' array (images) "
        "is refused before start (docs/normalization.md).",
    )
    normalize_rewards: bool = Field(
        False,
        description="Divide each reward by the running standard deviation of the discounted return (with "
        "discount), clipped to +-10, before the advantages are estimated (VecNormalize, CleanRL's "
        "NormalizeReward); episode returns are logged raw. The statistics (policy.reward_normalizer) are "
        "checkpointed and restored like normalize_observations' (docs/normalization.md).",
    )
    # --- data loading -------------------------------------------------------------------------
    num_readers: int = setting(
        4,
        "MineStudio-only, accepted and ignored with a warning: MineStudio's pool of reader actors. "
        "mineonline's trainer reads chunks straight from the replay store on its fetch thread.",
        ge=1,
        ignored="mineonline reads chunks straight from the replay store on the trainer's fetch thread",
    )
    num_cpus_per_reader: float = setting(
        0.1,
        "MineStudio-only, accepted and ignored with a warning: CPUs of each MineStudio reader.",
        gt=0,
        ignored="mineonline starts no reader actors",
    )
    prefetch_batches: int = setting(
        1,
        "Iterations of chunks fetched ahead while the current one trains, each held to max_staleness "
        "at the version it will be trained at; 0 fetches on demand. (MineStudio: batches its readers "
        "prefetch.)",
        ge=0,
    )
    # --- when to stop, which checkpoint to keep -----------------------------------------------
    max_env_steps: int | None = setting(
        None,
        "Stop after the first iteration at which the run has collected this many env steps (with a "
        "final checkpoint); null: no limit, num_iterations alone ends the run.",
        ge=1,
    )
    stop_at_return: float | None = Field(
        None,
        description="Stop once episode/return_mean, the mean return of the last "
        "episode_statistics_config.window episodes, reaches this value (checked once the window is "
        "full; with a final checkpoint); null: never.",
    )
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint of the iteration with the highest keep_best_metric so far "
        "(episode/return_mean once its window is full), in <save_path>/best/ with best.json; "
        "keep_interval never deletes it.",
    )
    keep_best_metric: Literal["episode/return_mean", "eval/return_mean"] = Field(
        "episode/return_mean",
        description="What keep_best judges by: episode/return_mean (the training episodes' moving "
        "window) or eval/return_mean (the evaluation's mean return, with eval_interval on; the "
        "checkpoint kept is the one of the iteration whose weights were evaluated).",
    )
    # --- evaluation while training (mineonline_core/services/evaluator.py) ----------------------
    eval_interval: int = setting(
        0,
        "Iterations between evaluations of the current weights, run by their own actor while rollout "
        "and training go on; eval/* metrics are logged at the env steps of the iteration evaluated. "
        "0 or null: no evaluation.",
        ge=0,
    )
    eval_episodes: int = setting(
        10,
        "Whole episodes per evaluation; episode i resets with seed seed + 1000000 + i, the same at every evaluation.",
        ge=1,
    )
    eval_deterministic: bool = Field(
        False, description="Evaluate with the most likely action (true) or sampled actions (false)."
    )
    eval_num_cpus: float = setting(1.0, "CPUs reserved for the evaluation actor.", gt=0)
    eval_num_gpus: float = setting(0.0, "GPUs reserved for the evaluation actor; 0 evaluates on CPU.", ge=0, le=1)
    # --- checkpoints, videos, resume ----------------------------------------------------------
    save_interval: int = setting(10, "Iterations between checkpoints.", ge=1)
    keep_interval: int = setting(
        40,
        "Checkpoints at multiples of this iteration count are kept; the others are deleted "
        "once a newer checkpoint exists.",
        ge=1,
    )
    record_video_interval: int = setting(2, "Iterations between recorded rollout videos; 0 disables videos.", ge=0)
    resume: str | None = Field(
        None,
        description="Checkpoint directory to continue from, or null/'' to start fresh; training "
        "continues at the iteration after the checkpoint's.",
    )
    resume_optimizer: bool = Field(True, description="When resuming, also restore the optimiser and AMP scaler state.")
    save_path: str = Field(
        "checkpoints",
        description="Checkpoint directory; relative paths are under the run directory. null means the default.",
    )
    max_trainer_restarts: int = setting(
        2,
        "Times a dead train worker (rank) is restarted, each time from the latest checkpoint "
        "of this run, before the run fails; 0 fails at the first death.",
        ge=0,
    )
    # --- numerics (mineonline_core/config/precision.py decides for rollout and training together) ---
    use_amp: bool = Field(
        False,
        description="Mixed precision: rollout inference and the training forwards autocast to amp_dtype, "
        "one decision for both (docs/cluster.md, Precision); false computes in float32.",
    )
    amp_dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto",
        description="The autocast dtype when use_amp is true. auto: bfloat16 (CPUs, CUDA from Ampere on; "
        "refused before start on an older GPU). float16 only when asked: it trains with a gradient "
        "scaler on CUDA and needs a policy that declares supports_float16.",
    )
    allow_tf32: bool = Field(
        False,
        description="Let float32 CUDA matmuls and convolutions run in TF32, in rollout and training alike "
        "(faster on Ampere and newer). Off by default: TF32 convolutions made training's log-probs "
        "differ from rollout's on on-policy data (mean 7e-3, max 4e-2).",
    )

    @field_validator("resume", mode="before")
    @classmethod
    def _empty_resume_is_none(cls, value: Any) -> Any:
        # MineStudio treats '' like None ("start from scratch"); keep that meaning.
        return None if isinstance(value, str) and value == "" else value

    @field_validator("eval_interval", mode="before")
    @classmethod
    def _none_eval_interval_is_off(cls, value: Any) -> Any:
        return 0 if value is None else value

    @field_validator("save_path", mode="before")
    @classmethod
    def _none_save_path_is_default(cls, value: Any) -> Any:
        # MineStudio accepts save_path None (its own default directory); ours is "checkpoints".
        return "checkpoints" if value is None else value
