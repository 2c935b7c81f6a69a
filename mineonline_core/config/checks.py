"""Cross-field checks that one field's validator cannot see, run before any actor starts."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from mineonline_core.config._fields import IGNORED
from mineonline_core.config.online import OnlineConfig
from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.errors import ConfigError

# Ray's own resource bookkeeping is in 1e-4 units; a smaller gap is rounding, not a shortage.
_EPS = 1e-4
MIN_HANG_TIMEOUT = 5.0


def _raise(problems: list[str], what: str) -> None:
    if problems:
        raise ConfigError(f"Inconsistent config ({what}):\n" + "\n".join(f"  - {p}" for p in problems))


def check_consistency(cfg: OnlineConfig) -> None:
    """Raise ``ConfigError`` listing every combination of values that cannot work together."""
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    wc, rb = rollout_config.worker_config, rollout_config.replay_buffer_config
    problems: list[str] = []
    if train_config.batches_per_iteration % train_config.gradient_accumulation:
        problems.append(
            f"train_config.batches_per_iteration ({train_config.batches_per_iteration}) is not a multiple of "
            f"train_config.gradient_accumulation ({train_config.gradient_accumulation}), so the last "
            f"optimiser step of each iteration would see a partial accumulation. Fix: make "
            f"batches_per_iteration a multiple of gradient_accumulation, e.g. "
            f"{_round_up(train_config.batches_per_iteration, train_config.gradient_accumulation)}."
        )
    if wc.batch_size > wc.num_envs:
        problems.append(
            f"rollout_config.worker_config.batch_size ({wc.batch_size}) exceeds "
            f"rollout_config.worker_config.num_envs ({wc.num_envs}): an inference batch cannot "
            f"hold more envs than a worker runs. Fix: lower batch_size to at most {wc.num_envs} "
            f"or raise num_envs."
        )
    per_iteration = train_config.num_workers * train_config.batches_per_iteration * train_config.batch_size_per_gpu
    if per_iteration > rb.max_chunks:
        problems.append(
            f"One iteration needs {per_iteration} chunks (train_config.num_workers "
            f"{train_config.num_workers} x batches_per_iteration {train_config.batches_per_iteration} x "
            f"batch_size_per_gpu {train_config.batch_size_per_gpu}) but "
            f"rollout_config.replay_buffer_config.max_chunks is {rb.max_chunks}, so the trainer "
            f"would wait forever. Fix: raise max_chunks to at least {per_iteration} or lower "
            f"those train_config values."
        )
    if train_config.use_ray_train is False and train_config.num_workers > 1:
        problems.append(
            f"train_config.use_ray_train is false, which trains one rank in the driver's process, but "
            f"train_config.num_workers is {train_config.num_workers}. Fix: set use_ray_train to null (Ray Train for "
            f"several ranks), or num_workers 1."
        )
    chunk_steps = rollout_config.fragment_length * rb.fragments_per_chunk
    if train_config.context_length > chunk_steps:
        problems.append(
            f"train_config.context_length ({train_config.context_length}) is longer than a chunk "
            f"({chunk_steps} steps = rollout_config.fragment_length {rollout_config.fragment_length} x "
            f"replay_buffer_config.fragments_per_chunk {rb.fragments_per_chunk}). Fix: lower "
            f"context_length to at most {chunk_steps} or raise fragment_length."
        )
    problems += _hang_problems(cfg) + _precision_problems(cfg) + _evaluation_problems(cfg)
    _raise(problems, "values that cannot work together")


def _hang_problems(cfg: OnlineConfig) -> list[str]:
    """``hang_timeout`` must let a busy process report (workers every 2 s, ranks every quarter of it)
    and must act before ``progress_timeout`` blames the wrong side (``services/heartbeat.py``)."""
    hang, progress = cfg.hang_timeout, cfg.progress_timeout
    if hang and hang < MIN_HANG_TIMEOUT:
        return [
            f"hang_timeout is {hang:g}s, shorter than {MIN_HANG_TIMEOUT:g}s: a rollout worker or trainer rank "
            f"that is merely busy would be killed as hung. Fix: set hang_timeout to at least "
            f"{MIN_HANG_TIMEOUT:g} (the default is 60), or 0 to disable hang detection."
        ]
    # Only a hang_timeout the user set: a short progress_timeout with the default one is a choice to stop first.
    if hang and progress and hang >= progress and "hang_timeout" in cfg.model_fields_set:
        return [
            f"hang_timeout ({hang:g}s) is not below progress_timeout ({progress:g}s): a hung rollout worker "
            f"or rank would end the run as a stall instead of being named and restarted. Fix: lower "
            f"hang_timeout below {progress:g} (the default is 60), or raise progress_timeout."
        ]
    return []


def _evaluation_problems(cfg: OnlineConfig) -> list[str]:
    """``keep_best_metric`` that nothing would judge by, an evaluation that would never run."""
    train_config, problems = cfg.train_config, []
    judged_by_eval = train_config.keep_best_metric.startswith("eval/")
    if judged_by_eval and not train_config.eval_interval:
        problems.append(
            f"train_config.keep_best_metric is {train_config.keep_best_metric!r} but eval_interval is 0, so no evaluation "
            f"runs and keep_best would never keep a checkpoint. Fix: set train_config.eval_interval (e.g. 10), or "
            f"keep_best_metric: episode/return_mean."
        )
    if judged_by_eval and not train_config.keep_best:  # (the default is in every saved config: not a choice)
        problems.append(
            f"train_config.keep_best_metric is {train_config.keep_best_metric!r} but keep_best is false, so it has no effect. "
            f"Fix: set train_config.keep_best: true, or remove keep_best_metric."
        )
    if train_config.eval_interval > train_config.num_iterations:
        problems.append(
            f"train_config.eval_interval ({train_config.eval_interval}) exceeds num_iterations ({train_config.num_iterations}), so no "
            f"evaluation would run. Fix: set eval_interval to at most {train_config.num_iterations}, or 0 to evaluate never."
        )
    return problems


def _precision_problems(cfg: OnlineConfig) -> list[str]:
    """``amp_dtype`` without ``use_amp``; bfloat16 on a GPU this driver sees and that lacks it (a driver
    without CUDA cannot tell: the trainer rank and the rollout worker raise the same error on theirs)."""
    train_config = cfg.train_config
    if not train_config.use_amp:
        if "amp_dtype" in train_config.model_fields_set and train_config.amp_dtype != "auto":
            return [
                f"train_config.amp_dtype is {train_config.amp_dtype!r} but use_amp is false, so nothing autocasts and it has "
                f"no effect. Fix: set train_config.use_amp: true, or remove amp_dtype."
            ]
        return []
    gpus = {"train_config": train_config.num_gpus_per_worker, "rollout_config": cfg.rollout_config.num_gpus_per_worker}
    on_gpu = [section for section, n in gpus.items() if n > 0]
    if not on_gpu or train_config.amp_dtype == "float16":
        return []
    import torch  # only for a GPU run with mixed precision: config loading stays torch-free otherwise

    from mineonline_core.config.precision import PrecisionChoice, bf16_supported

    if not torch.cuda.is_available():
        return []
    where = f" ({' and '.join(s + '.num_gpus_per_worker > 0' for s in on_gpu)})"
    problem = PrecisionChoice.from_config(train_config).problem(
        device_type="cuda", bf16_supported=bf16_supported("cuda"), where=where
    )
    return [problem] if problem else []


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def inference_resources(rollout_config: RolloutConfig) -> tuple[float, float, float]:
    """``(CPUs of the shared inference server, its GPUs, GPUs of each rollout worker)``: with
    ``inference: shared`` the server takes the workers' GPU shares (one process uses one GPU at
    most) and one worker's CPUs; with ``local`` there is no server."""
    if rollout_config.inference == "local":
        return 0.0, 0.0, rollout_config.num_gpus_per_worker
    return (
        rollout_config.num_cpus_per_worker,
        min(1.0, rollout_config.num_rollout_workers * rollout_config.num_gpus_per_worker),
        0.0,
    )


def evaluation_resources(cfg: OnlineConfig) -> tuple[float, float]:
    """``(CPUs, GPUs)`` the evaluation actor reserves; none without ``eval_interval``."""
    train_config = cfg.train_config
    return (train_config.eval_num_cpus, train_config.eval_num_gpus) if train_config.eval_interval else (0.0, 0.0)


def required_resources(cfg: OnlineConfig) -> dict[str, float]:
    """CPUs and GPUs the run's workers (shared inference server, evaluation actor) reserve (the small
    actors reserve none)."""
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    server_cpus, server_gpus, worker_gpus = inference_resources(rollout_config)
    eval_cpus, eval_gpus = evaluation_resources(cfg)
    return {
        "CPU": rollout_config.num_rollout_workers * rollout_config.num_cpus_per_worker
        + server_cpus
        + train_config.num_workers * train_config.num_cpus_per_worker
        + eval_cpus,
        "GPU": rollout_config.num_rollout_workers * worker_gpus
        + server_gpus
        + train_config.num_workers * train_config.num_gpus_per_worker
        + eval_gpus,
    }


def check_resources(cfg: OnlineConfig, available: Mapping[str, float]) -> None:
    """Raise ``ConfigError`` when the cluster (``ray.cluster_resources()``) is too small.

    Rollout and train workers reserve their CPUs/GPUs for the whole run, so a shortfall would
    leave an actor pending forever instead of failing; catching it here turns a hang into an error.
    """
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    needed = required_resources(cfg)
    problems = []
    eval_cpus, eval_gpus = evaluation_resources(cfg)
    for resource, per in (("CPU", "num_cpus_per_worker"), ("GPU", "num_gpus_per_worker")):
        have = float(available.get(resource, 0.0))
        share = eval_gpus if resource == "GPU" else eval_cpus
        evaluation = (
            f" + the evaluation actor's train_config.eval_num_{resource.lower()}s {share:g}"
            if train_config.eval_interval
            else ""
        )
        if needed[resource] > have + _EPS:
            problems.append(
                f"The config asks for {needed[resource]:g} {resource}s: "
                f"rollout_config.num_rollout_workers {rollout_config.num_rollout_workers} x "
                f"rollout_config.{per} {getattr(rollout_config, per):g} + train_config.num_workers "
                f"{train_config.num_workers} x train_config.{per} {getattr(train_config, per):g}"
                f"{' (with inference: shared, the inference server too)' if rollout_config.inference == 'shared' else ''}"
                f"{evaluation}, but the Ray cluster "
                f"has {have:g}. Fix: lower those worker counts or per-worker {resource}s "
                f"(fractions are allowed), or add nodes with more {resource}s."
            )
    _raise(problems, "not enough resources in the Ray cluster")


def ignored_key_warnings(section: BaseModel, prefix: str = "train_config") -> list[str]:
    """One line per key of ``section`` declared ``setting(ignored=...)`` (MineStudio keys that configure
    machinery mineonline does not have) that the config sets to other than its default, saying it has
    no effect. The one check of ignored keys: ``load_config`` runs it on the core's ``train_config``,
    ``TrainLoop.preflight`` on the trainer's own options."""
    out = []
    for key, info in type(section).model_fields.items():
        why = (info.json_schema_extra or {}).get(IGNORED) if isinstance(info.json_schema_extra, dict) else None
        value = getattr(section, key)
        if why and key in section.model_fields_set and value != info.default:
            out.append(f"{prefix}.{key}: {value!r} has no effect ({why}).")
    return out
