"""The driver: MineStudio's entry points and ``run``, which is what ``mineonline run`` does.

``run`` validates and resolves everything before Ray starts, creates the run directory, starts the
logging actor, the rollout manager and the trainer, and hands over to ``driver/training.py``, which
trains while showing live progress and watching the actors; on the way out (normal end, Ctrl-C or
failure) the run leaves a checkpoint, the report and no stray actors.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from mineonline_core.config import LoadedConfig, OnlineConfig, check_resources, load_config
from mineonline_core.config.secrets import public_config, redact_override, redact_text
from mineonline_core.errors import ConfigError, RunFailedError, find_user_error, last_line
from mineonline_core.registry import PluginManager, get_plugin_manager
from mineonline_core.services.names import LOGGER_HUB, NAMESPACE, ROLLOUT_MANAGER, actor_name
from mineonline_core.driver.resolve import ResolvedRun, resolve, resolve_trainer
from mineonline_core.driver.rundir import (
    RUN_FILE,
    Ownership,
    claim_run,
    record_cluster,
    refuse_existing_run,
    restore,
    snapshot,
)
from mineonline_core.driver.watchdog import sigterm_as_ctrl_c

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.manager import RolloutManager
    from mineonline_core.services.loggerhub import LoggerHub
    from mineonline_core.services.runlog import RunLog
    from mineonline_core.trainer.loop import TrainLoop

log = logging.getLogger("mineonline")


def init_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Join ``address`` or start a local cluster whose dashboard, if any, binds to localhost only."""
    import ray

    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": True}
    if address:
        from mineonline_core.driver.lifecycle import check_token, prepare_auth_env
        from mineonline_core.services.runlog import SETUP_HOOK

        prepare_auth_env()  # Ray presents the cluster's token by itself only for "auto", not for host:port
        if address != "auto" and not address.startswith("ray://"):
            check_token(address)  # a rejected token in one line, not Ray's 20 s of C++ warnings and a ConnectionError
        # Processes of a cluster started elsewhere do not inherit this environment. A local cluster's do
        # (its raylet is this process's child), and there a job runtime_env is left out: with one, Ray
        # starts every actor through its runtime-env agent instead of reusing the prestarted workers,
        # 1 s or more per actor on 2 cores (benchmarks/RESULTS.md). Actors set up their own
        # logging either way (runlog.setup_actor_logging).
        env_vars = {k: os.environ[k] for k in ("WANDB_MODE", "WANDB_DIR", "PYTHONPATH") if k in os.environ}
        kwargs["runtime_env"] = {"env_vars": env_vars, "worker_process_setup_hook": SETUP_HOOK}
        ray.init(address=address, **kwargs)
    else:
        from mineonline_core.driver.localcluster import start_local_cluster

        start_local_cluster(
            num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, dashboard_host="127.0.0.1", **kwargs
        )


def _as_loaded(
    policy_generator: Callable | None, env_generator: Callable | None, online_cfg: Any, whole_config: str | None = None
) -> LoadedConfig:
    loaded = load_config(online_cfg)
    loaded.policy_generator = policy_generator or loaded.policy_generator
    loaded.env_generator = env_generator or loaded.env_generator
    loaded.source_text = whole_config or loaded.source_text
    return loaded


def _handles(cfg: OnlineConfig) -> tuple[ActorHandle[RolloutManager], ActorHandle[LoggerHub] | None]:
    import ray

    manager = ray.get_actor(actor_name(cfg.run_name, ROLLOUT_MANAGER), namespace=NAMESPACE)
    try:
        hub = ray.get_actor(actor_name(cfg.run_name, LOGGER_HUB), namespace=NAMESPACE)
    except ValueError:
        hub = None
    return manager, hub


def _start_hub(resolved: ResolvedRun, *, wait: bool = True) -> ActorHandle[LoggerHub]:
    import ray

    from mineonline_core.builtin.console import METRICS_FILE
    from mineonline_core.driver.continuity import resume_point, truncate_metrics
    from mineonline_core.services.loggerhub import start_logger_hub

    cfg = resolved.config
    point = resume_point(cfg.train_config.resume) if cfg.train_config.resume else None
    if point is not None:  # iterations after the checkpoint are trained again: their records go
        dropped = truncate_metrics(cfg.run_dir() / METRICS_FILE, point)
        if dropped:
            log.info("resume: dropped %d metrics records logged after iteration %d", dropped, point.iteration)
    hub = start_logger_hub(
        run_name=cfg.run_name,
        namespace=NAMESPACE,
        lifetime="detached" if cfg.detach_rollout_manager else None,
        wait=wait,
        run_dir=str(cfg.run_dir()),
        loggers=resolved.loggers,
        config=public_config(cfg),
        num_iterations=cfg.train_config.num_iterations,
        video_dir=str(cfg.resolve_path(cfg.rollout_config.worker_config.video_output_dir)),
    )
    if point is not None:
        ray.get(hub.set_env_steps.remote(point.env_steps))  # before any rollout worker adds to it
    return hub


def _start_manager(resolved: ResolvedRun, hub: ActorHandle[LoggerHub]) -> ActorHandle[RolloutManager]:
    from mineonline_core.contracts.envs import adapted
    from mineonline_core.rollout.manager import launch_rollout_manager
    from mineonline_core.config.generators import Deferred

    return launch_rollout_manager(
        policy_generator=Deferred(resolved.policy_generator),
        env_generator=Deferred(adapted(resolved.env_generator)),
        config=resolved.config,
        logger_hub=hub,
        store_cls=resolved.store_cls,
        store_options=resolved.store_options,
    )


# Run directories this process claimed through ``start_rolloutmanager``: held until it exits, as
# MineStudio's scripts start the manager and then train in the same process for the run's lifetime.
_CLAIMED: dict[Path, Ownership] = {}


def start_rolloutmanager(
    policy_generator: Callable, env_generator: Callable, online_cfg: Any
) -> ActorHandle[RolloutManager]:
    """MineStudio's entry point: validate, claim the run directory (another process that tries the
    same run is refused, as ``mineonline run`` is), then start the logging actor and the rollout manager."""
    pm = get_plugin_manager()
    resolved = resolve(_as_loaded(policy_generator, env_generator, online_cfg), pm)
    run_dir = resolved.config.run_dir().absolute()
    if run_dir not in _CLAIMED:
        _CLAIMED[run_dir] = claim_run(resolved.config, pm)
    _prepare_run_dir(resolved)
    init_ray()
    return _start_manager(resolved, _start_hub(resolved))


def start_trainer(
    policy_generator: Callable, env_generator: Callable, online_cfg: Any, whole_config: str | None = None
) -> dict:
    """MineStudio's entry point: train against the run's rollout manager until ``num_iterations``."""
    resolved = resolve(_as_loaded(policy_generator, env_generator, online_cfg, whole_config), get_plugin_manager())
    init_ray()
    manager, hub = _handles(resolved.config)
    return _trainer(resolved, manager, hub).fit()


def _trainer(
    resolved: ResolvedRun, manager: ActorHandle[RolloutManager] | None, hub: ActorHandle[LoggerHub] | None
) -> TrainLoop:
    from mineonline_core.trainer.base import build_loop

    cfg = resolved.config
    return build_loop(
        resolved.trainer_cls,
        rollout_manager=manager,
        policy_generator=resolved.policy_generator,
        env_generator=resolved.env_generator,
        config=cfg,
        run_dir=str(cfg.run_dir()),
        logger_hub=hub,
        whole_config=_public_source(resolved),
        saved_config=public_config(cfg),
        options=resolved.trainer_options,
    )


def _public_source(resolved: ResolvedRun) -> str | None:
    """The config file's text as checkpoints store it (scrubbed), or None when there was no file."""
    return redact_text(resolved.source_text) if resolved.source_text else None


def _prepare_run_dir(resolved: ResolvedRun, *, overrides: Sequence[str] = ()) -> Path:
    import yaml

    cfg = resolved.config
    run_dir = cfg.run_dir()
    save_dir = cfg.resolve_path(cfg.train_config.save_path)
    for directory, key in ((run_dir, "output_dir"), (save_dir, "train_config.save_path")):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"{key}: cannot write to {str(directory)!r} ({exc.strerror}). Fix: choose a writable directory."
            ) from None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(public_config(cfg), sort_keys=False))
    if resolved.source_text:
        (run_dir / "source_config.txt").write_text(redact_text(resolved.source_text))
    record = {
        "run_name": cfg.run_name,
        "source_path": resolved.source_path,
        "overrides": [redact_override(o) for o in overrides],
    }
    (run_dir / RUN_FILE).write_text(json.dumps(record, indent=2))
    return run_dir


def _inside(path: str, directory: Path) -> bool:
    return Path(path).expanduser().absolute().is_relative_to(directory)


def run(
    source: Any,
    overrides: Sequence[str] = (),
    *,
    address: str | None = None,
    resume: str | None = None,
    progress: bool = True,
    quiet: bool = False,
    force: bool = False,
    verbose: bool = False,
    pm: PluginManager | None = None,
    monitor: Callable[[dict], bool] | None = None,
) -> dict:
    """Validate, start everything, train to ``num_iterations`` (or until Ctrl-C), clean up.

    Before Ray starts: the config is validated and resolved, the run directory (and a persistent
    store) locked for this process, and for a resume the checkpoint verified and the config compared
    with the one it was trained with (``resume``; ``force`` accepts continuity-breaking changes).
    The console shows mineonline's own output; Ray's and the libraries' go to ``run.log`` in the run
    directory (``verbose``: to the console as well). ``progress=False``: plain progress lines instead of
    the live panel; ``quiet``: neither, and no summary table: warnings, errors and the final line only.

    Inside a Ray worker (a Tune trial, ``driver/tune.py``) the run joins that Ray and leaves it running.
    ``monitor`` is called on this thread with the logging actor's latest metrics about once a second;
    a True return stops the run as Ctrl-C does (final checkpoint, status "interrupted").
    """
    from mineonline_core.driver.budget import machine_memory
    from mineonline_core.driver.mainguard import check_generators_named, check_main_guard
    from mineonline_core.driver.resume import check_continuity, check_model, plan_resume, progressed, verified_resume

    check_main_guard()  # a script without `if __name__ == "__main__":` would die in its env processes
    plan = plan_resume(resume, overrides) if resume is not None else None
    loaded = load_config(plan.source if plan else source, plan.overrides if plan else list(overrides))
    if loaded.from_scratch and not quiet:
        # Information, not a warning: stdout, once, before the run starts (and not in the quiet mode's one line).
        print(loaded.from_scratch, flush=True)
    check_generators_named(loaded)  # checkpoints must name the generators that rebuild the policy
    cfg = loaded.config
    pm = pm or get_plugin_manager()
    resolve_trainer(loaded, pm)  # the trainer's own keys, before the run directory is claimed
    with claim_run(cfg, pm):
        resuming_here = cfg.train_config.resume is not None and _inside(cfg.train_config.resume, cfg.run_dir())
        if plan is None and not resuming_here:
            refuse_existing_run(cfg.run_dir(), str(cfg.run_name))
        resolved = resolve(loaded, pm, isolate=True)
        if address is None and resolved.memory is not None:
            available, where = machine_memory()
            resolved.memory.check(available, where)
        if cfg.train_config.resume is not None:
            checkpoint = plan.checkpoint if plan else verified_resume(cfg.train_config.resume)
            if plan is not None or resuming_here:
                for line in check_continuity(cfg, checkpoint, plan.run_dir if plan else cfg.run_dir(), force=force):
                    print(f"resume: {line}")
            check_model(resolved, checkpoint)
        records = snapshot(cfg.run_dir())
        result: dict = {}
        try:
            result = _run_owned(
                resolved,
                pm,
                overrides=plan.recorded if plan else list(overrides),
                address=address,
                progress=progress,
                quiet=quiet,
                verbose=verbose,
                monitor=monitor,
            )
        finally:
            if plan is not None and not progressed(cfg, plan.checkpoint) and result.get("status") != "completed":
                restore(cfg.run_dir(), records)  # a failed attempt leaves run.json and config.yaml as they were
        return result


def _run_owned(
    resolved: ResolvedRun,
    pm: PluginManager,
    *,
    overrides: list[str],
    address: str | None,
    progress: bool,
    quiet: bool,
    verbose: bool,
    monitor: Callable[[dict], bool] | None = None,
) -> dict:
    from mineonline_core.services.runlog import RunLog
    from mineonline_core.driver.supervise import note_run_dir

    cfg = resolved.config
    run_dir = _prepare_run_dir(resolved, overrides=overrides)
    note_run_dir(run_dir)  # for the resume command, should Ray end this process (driver/supervise.py)
    os.environ.setdefault("WANDB_MODE", "offline")
    pm.hook.mineonline_run_start(config=cfg, run_dir=str(run_dir))
    with RunLog(run_dir, verbose=verbose) as run_log:
        status, result = _launch(
            resolved,
            pm,
            run_dir,
            address=address,
            progress=None if quiet else progress,
            run_log=run_log,
            monitor=monitor,
        )
    result["status"], result["run_dir"] = status, str(run_dir)
    if result["summary"] and monitor is None and not quiet:  # a Tune trial's summary is its table row
        from mineonline_core.driver.progress import print_summary

        # The table is printed here, on the driver, not in the logging actor whose output Ray prefixes.
        # One env_steps row: the hub's count, continued from the checkpoint on a resume.
        metrics = {k: v for k, v in result["summary"].items() if k != "env_steps"}
        print_summary(metrics, env_steps=result["summary"].get("env_steps"))
    print(f"run {cfg.run_name} {status}: {run_dir}")
    return result


def _launch(
    resolved: ResolvedRun,
    pm: PluginManager,
    run_dir: Path,
    *,
    address: str | None,
    progress: bool | None,
    run_log: RunLog,
    monitor: Callable[[dict], bool] | None = None,
) -> tuple[str, dict]:
    """Start Ray and the run's actors, train, and tear everything down whatever happens."""
    import ray

    from mineonline_core.services.loggerhub import check_logger_hub
    from mineonline_core.driver.placement import check_placement
    from mineonline_core.driver.training import shutdown_actors, train_with_progress, write_report

    cfg = resolved.config
    started_ray = not ray.is_initialized()
    init_ray(address)
    record_cluster(run_dir, ray.get_runtime_context().gcs_address)
    run_log.attach_actor_output()
    status, result, manager, hub = "failed", {}, None, None
    restore_sigterm = sigterm_as_ctrl_c()  # a preempted run stops like Ctrl-C: final checkpoint, clean exit
    try:
        check_resources(cfg, ray.cluster_resources())
        check_placement(cfg, ray.nodes(), address)  # the largest actor must fit one node, not the sum
        # The hub and the manager start side by side: actor start-up is mostly process start-up.
        hub = _start_hub(resolved, wait=False)
        try:
            manager = _start_manager(resolved, hub)
        except ray.exceptions.RayError as exc:
            raise find_user_error(exc) or RunFailedError(
                f"the rollout manager failed to start: {last_line(exc)}"
            ) from exc
        check_logger_hub(hub, cfg.run_name)
        result = train_with_progress(_trainer(resolved, manager, hub), manager, hub, cfg, progress, monitor)
        status = result.get("status", "completed")
    except KeyboardInterrupt:
        status = "interrupted"
    finally:
        result["summary"] = shutdown_actors(manager, hub)
        # Plotting (CPU) and stopping Ray (mostly waiting for its processes) overlap.
        report = threading.Thread(target=write_report, args=(run_dir,), name="mineonline-report")
        report.start()
        if started_ray:
            ray.shutdown()
        report.join()
        try:
            pm.hook.mineonline_run_finish(config=cfg, run_dir=str(run_dir), status=status)
        except Exception:  # noqa: BLE001 - documented: a finish hook cannot change the outcome
            log.exception("a mineonline_run_finish hook failed")
        restore_sigterm()
    return status, result
