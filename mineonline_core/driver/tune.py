"""Sweeps and seeds: ``mineonline tune`` and ``tune()``, a Ray Tune experiment whose trials are runs.

Everything a user can get wrong (the search-space grammar, ``driver/sweep.py``; every end of every space
as a config; the scheduler's metric and options) is checked before Ray starts. Then one Tune experiment
runs on one Ray cluster (this machine's, or ``address``): each trial is a ``TrialRun``
(``driver/trial.py``) that reserves, as a placement group sized from its resolved config, the CPU of the
trainer rank that runs in the trial's process and one bundle per rollout worker (and the shared inference
server), so the cluster's CPUs and GPUs bound how many trials run at once. Ray Train ranks
(``train_config.num_workers > 1``) and a driver-side GPU lease reserve through Ray Train's own placement
group and the cluster, outside the trial's.

Trials are ordinary runs: one run directory each, ``<output_dir>/<experiment>/<experiment>-<n>-<params>``,
with its checkpoints, metrics and loggers (wandb's group is the experiment). The experiment's directory
also holds Tune's state, ``tune.json`` (what ``--resume`` needs besides it) and ``results.csv``, the table
printed at the end. Schedulers: ASHA and PBT, on ``trainer/iteration`` and any metric the runs log.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime
import json
import logging
import os
import re
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Sequence

from mineonline_core.errors import ConfigError, last_line
from mineonline_core.driver.sweep import (
    Space,
    TrialSpec,
    config_spaces,
    split_overrides,
    trial_name,
    trial_overrides,
    validate,
)

DEFAULT_METRIC = "episode/return_mean"
SCHEDULERS = ("fifo", "asha", "pbt")
SEARCHES = ("random", "optuna")
TIME_ATTR = "trainer/iteration"
SPEC_FILE, RESULTS_FILE = "tune.json", "results.csv"
COLUMNS = ("trial", "parameters", "metric", "iterations", "status", "run_dir")


def tune(
    source: Any = None,
    overrides: Sequence[str] = (),
    *,
    name: str | None = None,
    seeds: str | None = None,
    scheduler: str = "fifo",
    metric: str = DEFAULT_METRIC,
    mode: str = "max",
    num_samples: int = 1,
    grace_period: int | None = None,
    perturbation_interval: int | None = None,
    address: str | None = None,
    resume: str | None = None,
    search: str = "random",
) -> list[dict]:
    """Run (or, with ``resume`` = the experiment's directory, continue) a sweep; return the results table's rows.

    ``overrides`` mix plain overrides and search spaces (``driver/sweep.py``); ``seeds`` (``"0,1,2"``) is a
    grid over ``seed``. ``scheduler``: ``fifo`` (every trial to the end), ``asha`` (stops trials whose
    ``metric`` trails at ``grace_period``, 2x, 4x... iterations) or ``pbt`` (every ``perturbation_interval``
    iterations the worse trials continue from a better one's checkpoint with perturbed parameters). ``search``:
    ``random`` (Tune's grid and random draws) or ``optuna`` (Optuna's TPE proposes each trial's values from
    the results of the trials before it; ``num_samples`` trials in all, no grids)."""
    if resume is not None:
        spec, spaces, options = _load_spec(resume)
    else:
        spec, spaces, options = _plan(
            source,
            overrides,
            name=name,
            seeds=seeds,
            scheduler=scheduler,
            metric=metric,
            mode=mode,
            num_samples=num_samples,
            grace_period=grace_period,
            perturbation_interval=perturbation_interval,
            search=search,
        )
    import ray
    from ray import tune as ray_tune

    from mineonline_core.driver.api import init_ray
    from mineonline_core.driver.trial import TrialRun

    started_ray = not ray.is_initialized()
    init_ray(address)
    try:
        trainable = ray_tune.with_resources(ray_tune.with_parameters(TrialRun, spec=spec), resources=_resources(spec))
        exp_dir = Path(spec.experiment_dir)
        if resume is not None:
            tuner = ray_tune.Tuner.restore(
                str(exp_dir), trainable=trainable, resume_unfinished=True, resume_errored=False
            )
        else:
            tuner = ray_tune.Tuner(
                trainable,
                param_space={s.key: s.to_tune() for s in spaces},
                tune_config=ray_tune.TuneConfig(
                    num_samples=options["num_samples"],
                    scheduler=_scheduler(options, spaces),
                    search_alg=_search(options),
                    metric=spec.metric,
                    mode=options["mode"],
                    reuse_actors=False,
                    trial_dirname_creator=lambda t: trial_name(spec, t.trial_id, t.config),
                    trial_name_creator=lambda t: trial_name(spec, t.trial_id, t.config),
                ),
                run_config=ray_tune.RunConfig(name=spec.experiment, storage_path=str(exp_dir.parent), verbose=1),
            )
        with resume_hint(exp_dir):
            grid = tuner.fit()
        rows = _rows(grid, spec, options)
    finally:
        if started_ray:
            ray.shutdown()
    _write_table(rows, exp_dir / RESULTS_FILE)
    return rows


@contextlib.contextmanager
def resume_hint(exp_dir: Path) -> Iterator[None]:
    """While Tune runs the experiment: its interruption warning names ``mineonline tune --resume``, not Ray's
    own ``Tuner.restore(...)``, an API a CLI user does not call."""
    tune_log, hint = logging.getLogger("ray.tune.tune"), _ResumeHint(exp_dir)
    tune_log.addFilter(hint)
    try:
        yield
    finally:
        tune_log.removeFilter(hint)


class _ResumeHint(logging.Filter):
    """Turns Tune's interruption warning into the command that continues the experiment."""

    def __init__(self, exp_dir: Path) -> None:
        super().__init__()
        self.exp_dir = exp_dir

    def filter(self, record: logging.LogRecord) -> bool:
        if "has been interrupted" in record.getMessage():
            record.msg = f"the sweep was interrupted; its state is saved. Continue it with: mineonline tune --resume {self.exp_dir}"
            record.args = ()
        return True


def _plan(
    source: Any,
    overrides: Sequence[str],
    *,
    name: str | None,
    seeds: str | None,
    scheduler: str,
    metric: str,
    mode: str,
    num_samples: int,
    grace_period: int | None,
    perturbation_interval: int | None,
    search: str = "random",
) -> tuple[TrialSpec, list[Space], dict]:
    """Validate everything and write ``tune.json``; no Ray yet."""
    if source is None:
        raise ConfigError("mineonline tune: give a CONFIG file, or --resume EXPERIMENT_DIR to continue an experiment.")
    if scheduler not in SCHEDULERS:
        raise ConfigError(f"--scheduler {scheduler!r} is not one of {', '.join(SCHEDULERS)}. Fix: choose one of them.")
    if mode not in ("max", "min"):
        raise ConfigError(f"--mode {mode!r}: give max (a return) or min (a loss).")
    if num_samples < 1:
        raise ConfigError(f"--num-samples {num_samples}: give 1 or more (draws of the random spaces per grid point).")
    if search not in SEARCHES:
        raise ConfigError(f"--search {search!r} is not one of {', '.join(SEARCHES)}. Fix: choose one of them.")
    fixed, spaces = split_overrides(overrides, seeds=seeds)
    given = {o.split("=", 1)[0].strip() for o in fixed} | {s.key for s in spaces}
    spaces = [s for s in config_spaces(source) if s.key not in given] + spaces
    _check_search(search, spaces, scheduler)
    if scheduler == "pbt" and not any(s.kind in ("loguniform", "uniform", "choice", "randint") for s in spaces):
        raise ConfigError(
            "--scheduler pbt perturbs the random spaces (loguniform, uniform, randint, choice), and none is "
            "given. Fix: sweep a key with one, e.g. train_config.learning_rate=loguniform(1e-5,1e-3)."
        )
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            "tune() takes a config file's path (YAML or Python module): each trial loads it in its own process."
        )
    source = str(Path(source).expanduser().absolute())
    loaded = validate(source, fixed, spaces)
    cfg = loaded.config
    experiment = name or (
        str(cfg.run_name) if "run_name" in given else datetime.datetime.now().strftime("tune-%Y%m%d-%H%M%S")
    )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9.=+-]*", experiment):
        raise ConfigError(
            f"--name {experiment!r}: the experiment's name starts its trials' run names, so it must be a "
            "folder name of letters, digits and . = + -. Fix: give e.g. --name lr-sweep."
        )
    fixed = [o for o in fixed if o.split("=", 1)[0].strip() not in ("run_name", "output_dir")]
    if "wandb" in cfg.logger_config.loggers and "group" not in (cfg.logger_config.model_extra or {}):
        fixed.append(f"logger_config.group={experiment}")
    iterations = cfg.train_config.num_iterations
    for option, value in (("--grace-period", grace_period), ("--perturbation-interval", perturbation_interval)):
        if value is not None and not 1 <= value <= iterations:
            raise ConfigError(
                f"{option} {value}: give a number of iterations from 1 to train_config.num_iterations ({iterations})."
            )
    exp_dir = Path(cfg.output_dir).expanduser().absolute() / experiment
    if (exp_dir / SPEC_FILE).exists():
        raise ConfigError(
            f"--name {experiment}: {exp_dir} already holds a tune experiment. Fix: continue it with "
            f"`mineonline tune --resume {exp_dir}`, or give another --name."
        )
    spec = TrialSpec(
        source=source,
        fixed=tuple(fixed),
        keys=tuple(s.key for s in spaces),
        experiment=experiment,
        experiment_dir=str(exp_dir),
        metric=metric,
        cwd=os.getcwd(),
    )
    options = {
        "scheduler": scheduler,
        "mode": mode,
        "num_samples": num_samples,
        "search": search,
        "seed": cfg.seed,
        "iterations": iterations,
        "grace_period": grace_period or max(1, iterations // 8),
        "perturbation_interval": perturbation_interval or max(1, iterations // 8),
    }
    exp_dir.mkdir(parents=True, exist_ok=True)
    record = {"spec": dataclasses.asdict(spec), "spaces": [dataclasses.asdict(s) for s in spaces], "options": options}
    (exp_dir / SPEC_FILE).write_text(json.dumps(record, indent=2))
    return spec, spaces, options


def _load_spec(resume: str) -> tuple[TrialSpec, list[Space], dict]:
    path = Path(resume).expanduser().absolute() / SPEC_FILE
    if not path.is_file():
        raise ConfigError(
            f"--resume {resume}: no {SPEC_FILE} there, so it is not a mineonline tune experiment. "
            "Fix: give the experiment's directory, <output_dir>/<experiment>."
        )
    record = json.loads(path.read_text())
    spec = TrialSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["spec"].items()})
    spaces = [Space(s["key"], s["kind"], tuple(s["values"])) for s in record["spaces"]]
    return spec, spaces, record["options"]


def bundles(cfg: Any) -> list[dict[str, float]]:
    """The trial's placement group: its own process (the in-process trainer rank), then one bundle per
    rollout worker and the shared inference server. Empty bundles are dropped; an empty head bundle
    means the trial's process takes nothing from the group (Tune's convention)."""
    from mineonline_core.config.checks import inference_resources

    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    in_process = not (
        train_config.use_ray_train if train_config.use_ray_train is not None else train_config.num_workers > 1
    )
    head = (
        {"CPU": train_config.num_cpus_per_worker}
        if in_process and train_config.num_gpus_per_worker == 0 and train_config.num_cpus_per_worker > 0
        else {}
    )
    server_cpus, server_gpus, worker_gpus = inference_resources(rollout_config)
    worker = {k: v for k, v in (("CPU", rollout_config.num_cpus_per_worker), ("GPU", worker_gpus)) if v > 0}
    server = {k: v for k, v in (("CPU", server_cpus), ("GPU", server_gpus)) if v > 0}
    return [head, *([worker] * rollout_config.num_rollout_workers if worker else []), *([server] if server else [])]


def _resources(spec: TrialSpec) -> Any:
    from ray.tune import PlacementGroupFactory

    from mineonline_core.config import load_config

    def for_trial(config: dict) -> PlacementGroupFactory:
        cfg = load_config(spec.source, [*spec.fixed, *trial_overrides(spec, config)]).config
        return PlacementGroupFactory(bundles(cfg))

    return for_trial


def _scheduler(options: dict, spaces: list[Space]) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if options["scheduler"] == "asha":
        return ASHAScheduler(
            time_attr=TIME_ATTR, max_t=options["iterations"], grace_period=options["grace_period"], reduction_factor=2
        )
    if options["scheduler"] == "pbt":
        mutations = {s.key: s.to_tune() for s in spaces if s.kind != "grid"}
        return PopulationBasedTraining(
            time_attr=TIME_ATTR, perturbation_interval=options["perturbation_interval"], hyperparam_mutations=mutations
        )
    return FIFOScheduler()


def _check_search(search: str, spaces: list[Space], scheduler: str) -> None:
    if search != "optuna":
        return
    grids = [s.text for s in spaces if s.kind == "grid"]
    if grids:
        raise ConfigError(
            f"--search optuna proposes every value itself and takes no grid: {', '.join(grids)}. Fix: make it "
            "choice(...) (seeds too: seed=choice(0,1,2)), or sweep the grid with --search random."
        )
    if not spaces:
        raise ConfigError(
            "--search optuna needs a space to search, and none is given. Fix: sweep a key, e.g. "
            "train_config.learning_rate=loguniform(1e-5,1e-3), with --num-samples trials."
        )
    if scheduler == "pbt":
        raise ConfigError(
            "--search optuna with --scheduler pbt: PBT changes a trial's values while it runs, which Optuna's "
            "proposals cannot follow. Fix: --scheduler asha (or fifo) with optuna, or pbt with --search random."
        )


def _search(options: dict) -> Any:
    """Tune's searcher for ``options["search"]``: None (Tune's grid and random draws) or Optuna's TPE,
    seeded by the config's seed so that a sweep proposes the same first values each time."""
    if options.get("search", "random") != "optuna":
        return None
    try:
        from ray.tune.search.optuna import OptunaSearch
    except ImportError as exc:  # pragma: no cover - the message when optuna is missing
        raise ConfigError(
            f"--search optuna needs the optuna package ({exc}). Fix: pip install 'mineonline-core[optuna]'"
        ) from exc
    return OptunaSearch(seed=int(options.get("seed", 0)))


def _rows(grid: Any, spec: TrialSpec, options: dict) -> list[dict]:
    """One row per trial: its parameters, the metric's last value, iterations, how it ended, its run dir."""
    from mineonline_core.trainer.checkpoint import list_checkpoints

    rows = []
    for result in grid:
        metrics = result.metrics or {}
        config = result.config or {}
        run_dir = Path(result.path) if result.path else None
        # The run's own last checkpoint: a stopped trial's run goes on to the end of its iteration.
        saved = list_checkpoints(run_dir / "checkpoints") if run_dir is not None else []
        iterations = saved[-1][0] if saved else int(metrics.get(TIME_ATTR, 0) or 0)
        if result.error is not None:
            cause = last_line(result.error)
            status = "failed: " + re.sub(r"^[\w.]*RunFailedError: ", "", cause)
        elif iterations >= options["iterations"]:
            status = "completed"
        elif metrics.get("done"):  # a scheduler's stop, or a goal the run reached
            status = str(metrics.get("run_status", f"stopped early ({options['scheduler']})"))
        else:
            status = "interrupted" if metrics else "not started"
        value = _run_summary(run_dir).get(spec.metric, metrics.get(spec.metric))
        rows.append(
            {
                "trial": Path(result.path).name if result.path else "?",
                "parameters": " ".join(trial_overrides(spec, config)),
                "metric": "" if value is None else f"{value:.4g}",
                "iterations": iterations,
                "status": status,
                "run_dir": result.path or "",
            }
        )
    return sorted(rows, key=lambda r: r["trial"])


def _run_summary(run_dir: Path | None) -> dict:
    """The run's own last values (summary.json): a trial a scheduler stopped ends its iteration and writes
    them after the last result Tune took from it, so the table shows the run's numbers, not Tune's last."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text()) if run_dir is not None else {}
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _write_table(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(format_table(rows))
    print(f"results: {path}")


def format_table(rows: list[dict]) -> str:
    """The table as aligned text, the run directory last."""
    padded = COLUMNS[:-1]
    widths = {c: max([len(c), *(len(str(r[c])) for r in rows)]) for c in padded}
    lines = ["  ".join([*(c.ljust(widths[c]) for c in padded), COLUMNS[-1]])]
    lines += ["  ".join([*(str(r[c]).ljust(widths[c]) for c in padded), str(r[COLUMNS[-1]])]) for r in rows]
    return "\n".join(lines)
