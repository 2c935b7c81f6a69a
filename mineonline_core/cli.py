"""The ``mineonline`` command line.

Errors a user can cause (``MineOnlineError``) are printed as their message alone, without a traceback,
and exit with status 2. ``run`` exits 0 when the run completed (its iterations, or a goal reached), 130
when it was interrupted (Ctrl-C, SIGTERM, ``mineonline stop``: stopped with a final checkpoint, to be
resumed), 1 when it failed. Heavy modules load only inside the command that needs them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from mineonline_core.errors import MineOnlineError

# The shell's status for a command ended by Ctrl-C: a script or scheduler tells a stopped run from a finished one.
EXIT_INTERRUPTED = 130


def _cmd_run(args: argparse.Namespace) -> int:
    if args.config is None and args.resume is None:
        raise MineOnlineError("mineonline run: give a CONFIG file, or --resume RUN_DIR to continue a run.")
    if not args.quiet:
        # Importing torch and Ray and starting a cold local cluster takes most of a minute before the run
        # has anything to show: say at once that it is under way.
        where = f"joining the Ray cluster at {args.address}" if args.address else "starting a local Ray cluster"
        print(
            f"mineonline run: checking the config, then {where} (the first run on a machine takes longest)", flush=True
        )
    from mineonline_core.driver.api import run

    if args.resume is not None and args.config is not None and "=" in args.config and not Path(args.config).exists():
        # `run --resume DIR key=value`: argparse hands the first override to the CONFIG slot; it is an override.
        args.overrides, args.config = [args.config, *args.overrides], None
    result = run(
        args.config,
        args.overrides,
        address=args.address,
        resume=args.resume,
        progress=not args.no_progress,
        quiet=args.quiet,
        force=args.force,
        verbose=args.verbose,
    )
    return {"completed": 0, "interrupted": EXIT_INTERRUPTED}.get(result.get("status"), 1)


def _cmd_tune(args: argparse.Namespace) -> int:
    from mineonline_core.driver.tune import tune

    if args.resume is not None and args.config is not None:
        raise MineOnlineError(
            "mineonline tune --resume EXPERIMENT_DIR continues an experiment as it was planned: "
            "give no CONFIG or overrides."
        )
    rows = tune(
        args.config,
        args.overrides,
        name=args.name,
        seeds=args.seeds,
        scheduler=args.scheduler,
        metric=args.metric,
        mode=args.mode,
        num_samples=args.num_samples,
        grace_period=args.grace_period,
        perturbation_interval=args.perturbation_interval,
        address=args.address,
        resume=args.resume,
        search=args.search,
    )
    if not rows or any(r["status"].startswith("failed") for r in rows):
        return 1
    return EXIT_INTERRUPTED if any(r["status"] in ("interrupted", "not started") for r in rows) else 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from mineonline_core.driver.evaluate import EVAL_FILE, evaluate

    result = evaluate(
        args.path,
        episodes=args.episodes,
        video=args.video,
        deterministic=args.deterministic,
        overrides=args.overrides,
        output=args.output,
        seed=args.seed,
        progress=not args.no_progress,
    )
    line = f"return {result['return_mean']:.2f} +- {result['return_std']:.2f}, length {result['length_mean']:.0f}"
    if "crafter" in result:
        line += f", Crafter score {result['crafter']['score']:.2f}%"
    print(f"{result['episodes']} episodes of {result['checkpoint']}: {line}; {Path(result['output']) / EVAL_FILE}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from mineonline_core.driver.export import export_policy

    result = export_policy(args.path, fmt=args.format, output=args.output)
    names = ", ".join(f"{io['name']} {io['dtype']} {tuple(io['shape'])}" for io in result["inputs"])
    outs = ", ".join(f"{io['name']} {io['dtype']} {tuple(io['shape'])}" for io in result["outputs"])
    print(f"exported {result['checkpoint']} ({args.format}) to {result['file']}: inputs {names}; outputs {outs}")
    print(f"signature: {result['signature']}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import yaml

    from mineonline_core.config import load_config
    from mineonline_core.config.secrets import public_config
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    # isolate: the env is built, reset and stepped once in a subprocess, as a rollout worker would.
    loaded = load_config(args.config, args.overrides)
    if loaded.from_scratch:
        print(loaded.from_scratch)
    resolved = resolve(loaded, get_plugin_manager(), isolate=True)
    print(
        yaml.safe_dump(public_config(resolved.config), sort_keys=False), end=""
    )  # secrets redacted, ${oc.env:..} kept
    if resolved.memory is not None:
        from mineonline_core.driver.budget import machine_memory

        available, where = machine_memory()
        print(f"# memory on one machine: {resolved.memory.describe()}", file=sys.stderr)
        try:
            resolved.memory.check(available, where)
        except MineOnlineError as exc:  # a warning here: the config may be meant for a larger machine or a cluster
            print(f"# warning: `mineonline run` on this machine would refuse it: {exc}", file=sys.stderr)
    print(
        f"# ok: trainer {resolved.trainer_cls.name}, store {resolved.store_cls.name}, loggers "
        f"{', '.join(cls.name for cls, _ in resolved.loggers)}; observation {resolved.observation_space}, "
        f"action {resolved.action_space}",
        file=sys.stderr,
    )
    return 0


def _cmd_plugins(args: argparse.Namespace) -> int:
    from mineonline_core.registry import get_plugin_manager, kind_table, with_kind_table
    from mineonline_core.trainer.algorithm import with_hook_table

    if args.table:
        if not args.output:
            print(kind_table(), end="")
            return 0
        target = Path(args.output)
        text = with_hook_table(with_kind_table(target.read_text()))
        if args.check and target.read_text() != text:
            raise MineOnlineError(
                f"{target}'s kind table or hook table is out of date with the kinds or the @hook marks. Fix: run `mineonline plugins --table "
                f"--output {target}`."
            )
        target.write_text(text)
        return 0
    pm = get_plugin_manager()
    for registry in pm.registries.values():
        print(f"{registry.kind.plural}:")
        for name, cls, origin in registry.items():
            print(f"  {name:<18} {origin.distribution} {origin.version}  ({cls.__module__}.{cls.__qualname__})")
    if pm.load_failures:
        print("failed to load:")
        for failure in pm.load_failures:
            print(f"  {failure}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from mineonline_core.config import config_docs, config_template

    text = config_template() if args.what == "template" else config_docs()
    if args.check:
        target = Path(args.output or "docs/configuration.md")
        if not target.exists() or target.read_text() != text:
            raise MineOnlineError(
                f"{target} is out of date with the config models. Fix: run `mineonline config docs --output {target}`."
            )
        print(f"{target} is up to date")
    elif args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from mineonline_core.driver.report import RETURN_KEY, write_report

    if len(args.run_dir) > 1 or args.output or args.metric:
        from mineonline_core.driver.compare import write_comparison

        for path in write_comparison(args.run_dir, output=args.output, keys=tuple(args.metric or [RETURN_KEY])):
            print(path)
        return 0
    run_dir = Path(args.run_dir[0])
    if not (run_dir / "metrics.jsonl").exists():
        raise MineOnlineError(f"{run_dir} holds no metrics.jsonl: give the directory of a run (runs/<run_name>).")
    for path in write_report(run_dir):
        print(path)
    return 0


ADDRESS_HELP = (
    "the Ray cluster (host:port, or auto: the one started last on this machine); default: the cluster the run "
    "directory's run.json recorded, else auto"
)


def _cmd_status(args: argparse.Namespace) -> int:
    from mineonline_core.driver.lifecycle import print_status, run_target

    run, address = run_target(args.run, args.address)
    return print_status(address=address, run=run)


def _cmd_stop(args: argparse.Namespace) -> int:
    from mineonline_core.driver.lifecycle import stop_runs

    if args.grace < 0:
        print(
            f"error: --grace={args.grace} is negative. Fix: give the seconds to wait for the run's driver "
            "to write its final checkpoint (default 30; longer for runs whose iteration takes longer).",
            file=sys.stderr,
        )
        return 2
    from mineonline_core.driver.lifecycle import run_target

    run, address = run_target(args.run, args.address)
    return stop_runs(run, address=address, grace_s=args.grace, every=args.all)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mineonline", description="Online RL fine-tuning on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a config: rollout workers, replay buffer and trainer")
    run.add_argument("config", nargs="?", help="a YAML file or a Python config module")
    run.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. train_config.learning_rate=1e-4")
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint, or from RUN_DIR/checkpoints/checkpoint_N",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept config changes that break continuity (network, env, fragment length, ...)",
    )
    run.add_argument("--address", help="the Ray cluster to join (default: start a local one)")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live display")
    run.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress lines and no summary table: warnings, errors, the last line",
    )
    run.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print Ray's and the libraries' messages (always in the run directory's run.log)",
    )
    run.set_defaults(func=_cmd_run)

    tn = sub.add_parser("tune", help="a Ray Tune experiment: one run per trial, over search spaces and seeds")
    tn.add_argument("config", nargs="?", help="a YAML file or a Python config module")
    tn.add_argument(
        "overrides",
        nargs="*",
        help="overrides and search spaces, e.g. train_config.learning_rate=loguniform(1e-5,1e-3) "
        "seed=0,1,2 (forms: loguniform, uniform, randint, choice, grid, a,b,c)",
    )
    tn.add_argument("--seeds", help="shorthand for a grid over the seed key, e.g. --seeds 0,1,2")
    tn.add_argument(
        "--name", help="experiment name: <output_dir>/<name> holds its trials' run directories (default tune-<time>)"
    )
    tn.add_argument("--scheduler", default="fifo", help="fifo (default), asha or pbt")
    tn.add_argument(
        "--search",
        default="random",
        choices=["random", "optuna"],
        help="random (default): grids and random draws; optuna: Optuna's TPE proposes each trial's values from "
        "the trials before it (--num-samples trials, no grids)",
    )
    tn.add_argument(
        "--metric",
        default="episode/return_mean",
        help="a metric the runs log, for the scheduler and the table (default episode/return_mean)",
    )
    tn.add_argument("--mode", default="max", help="max (default) or min")
    tn.add_argument("--num-samples", type=int, default=1, help="draws of the random spaces per grid point (default 1)")
    tn.add_argument(
        "--grace-period", type=int, help="asha: iterations before a trial can be stopped (default num_iterations/8)"
    )
    tn.add_argument(
        "--perturbation-interval", type=int, help="pbt: iterations between perturbations (default num_iterations/8)"
    )
    tn.add_argument(
        "--resume",
        metavar="EXPERIMENT_DIR",
        help="continue an interrupted experiment: its unfinished trials continue from their runs' latest checkpoints",
    )
    tn.add_argument("--address", help="the Ray cluster to join (default: start a local one)")
    tn.set_defaults(func=_cmd_tune)

    ev = sub.add_parser("eval", help="run episodes with a trained policy; write eval.json (and videos)")
    ev.add_argument(
        "path", metavar="RUN_DIR|CHECKPOINT", help="a run directory (its latest checkpoint) or a checkpoint directory"
    )
    ev.add_argument("overrides", nargs="*", help="dotlist overrides of the saved config, e.g. env_config.length=500")
    ev.add_argument("--episodes", type=int, help="episodes to run (default: the run's train_config.eval_episodes)")
    ev.add_argument("--video", action="store_true", help="write an mp4 of every episode")
    ev.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        help="take the most likely action instead of sampling (default: the run's train_config.eval_deterministic)",
    )
    ev.add_argument(
        "--seed",
        type=int,
        help="seed of the action sampling and of episode i's env reset (seed + i); default: the run's evaluation "
        "seeds while training (its seed + 1000000), so a checkpoint scores what evaluation while training said",
    )
    ev.add_argument(
        "--output",
        help="directory for eval.json and videos (default: RUN_DIR/eval/ and the checkpoint's path under its save "
        "dir: checkpoint_NNNNNN, best/checkpoint_NNNNNN)",
    )
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    ev.set_defaults(func=_cmd_eval)

    ex = sub.add_parser(
        "export", help="write a checkpoint's deterministic policy as TorchScript or ONNX, usable without mineonline"
    )
    ex.add_argument(
        "path", metavar="RUN_DIR|CHECKPOINT", help="a run directory (its latest checkpoint) or a checkpoint directory"
    )
    ex.add_argument("--format", choices=["torchscript", "onnx"], default="torchscript", help="default torchscript")
    ex.add_argument(
        "--output",
        help="the file to write (default: RUN_DIR/export/checkpoint_NNNNNN.pt or .onnx); its signature "
        "(inputs, outputs, dtypes, shapes) goes beside it as FILE.json",
    )
    ex.set_defaults(func=_cmd_export)

    check = sub.add_parser(
        "check", help="validate and resolve a config, and build, reset and step its env once, without starting Ray"
    )
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    check.set_defaults(func=_cmd_check)

    plugins = sub.add_parser("plugins", help="list registered components and plugin load failures")
    plugins.add_argument("--table", action="store_true", help="print the markdown table of every hook instead")
    plugins.add_argument("--output", help="with --table: put the kind and hook tables between their lines in this file")
    plugins.add_argument("--check", action="store_true", help="with --output: fail if the file's table is stale")
    plugins.set_defaults(func=_cmd_plugins)

    config = sub.add_parser("config", help="print the config template or the config reference")
    config.add_argument("what", choices=["template", "docs"])
    config.add_argument("--output", help="write to this file instead of stdout")
    config.add_argument("--check", action="store_true", help="fail if the file differs from what would be written")
    config.set_defaults(func=_cmd_config)

    report = sub.add_parser("report", help="write the PNG report of a run directory, or compare runs")
    report.add_argument("run_dir", nargs="+", help="one run: its PNG report; several: compared (seeds aggregated)")
    report.add_argument("--output", help="where the comparison goes (default: the first run's parent directory)")
    report.add_argument("--metric", action="append", help="metric to compare (repeatable; default episode/return_mean)")
    report.set_defaults(func=_cmd_report)

    status = sub.add_parser("status", help="list runs whose actors are alive")
    status.add_argument(
        "run", nargs="?", help="a run name or run directory: that run alone, on the cluster its run.json recorded"
    )
    status.add_argument("--address", help=ADDRESS_HELP)
    status.set_defaults(func=_cmd_status)

    stop = sub.add_parser("stop", help="stop a run's actors cleanly")
    stop.add_argument(
        "run",
        nargs="?",
        help="run name or run directory (default: the only alive run; several need a name or --all); a run "
        "directory is stopped on the cluster its run.json recorded",
    )
    stop.add_argument("--all", action="store_true", help="stop every alive run on the cluster")
    stop.add_argument("--address", help=ADDRESS_HELP)
    stop.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the run's driver to finish its iteration and write a final "
        "checkpoint before its actors are ended (default 30; a VPT iteration can take longer)",
    )
    stop.set_defaults(func=_cmd_stop)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may continue after an option (`run CFG a=1 --no-progress b=2`): argparse leaves them over.
    if extra and hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from mineonline_core.driver import supervise

    if args.command == "run" and args.address and not os.environ.get(supervise.OUTCOME_VAR):
        # A driver on a cluster can be ended by Ray from C++ (the head lost): a parent says why.
        return supervise.supervised(list(sys.argv[1:] if argv is None else argv), args.address)
    code = _dispatch(args)
    supervise.note_exit(code)
    return code


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return args.func(args)
    except MineOnlineError as exc:
        from mineonline_core.services.runlog import console_error

        print(f"error: {console_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> None:
    """The ``mineonline`` console script: ``main``, then, after ``run``, ``tune`` and ``stop``, an exit without
    the interpreter's teardown."""
    code = main()
    if sys.argv[1:2] in (["run"], ["tune"], ["stop"]):
        # run and tune have stopped Ray: unwinding torch and Ray would only add seconds. stop often outlives
        # the cluster it attached to, and Ray's teardown would wait a minute for that GCS, then exit 1 unflushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
