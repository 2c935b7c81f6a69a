"""One Tune trial = one mineonline run, in the trial's actor, on the cluster Tune runs on.

``TrialRun`` is a class trainable (not a function one) because a scheduler's stop must end the run the
way Ctrl-C does: ``cleanup`` asks the run to stop and waits for its final checkpoint, report and actor
teardown, where a function trainable's thread would be cut off mid-iteration. The run itself (``run``,
``driver/api.py``) goes on a thread of the actor; it joins the actor's Ray and never stops it, and its
rollout workers land in the trial's placement group (Tune captures the trial's child actors).

The run's driver loop calls ``_on_latest`` about once a second; it reads the records the run's logging
actor appended to ``metrics.jsonl`` since, and each training iteration (once the experiment's metric has
been logged) becomes one Tune result carrying the latest value of every metric. Reading the file, not the
actor's latest values, gives the scheduler every iteration even when several finish within a second. A
trial's run directory is its Tune trial directory, ``<output_dir>/<experiment>/<trial name>``; a trial
restarted by ``--resume`` continues from the latest checkpoint there, and one that PBT restarts from
another trial's checkpoint continues from that one, with its own new parameters.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
from pathlib import Path

from ray.tune import Trainable

from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.driver.sweep import TrialSpec, trial_overrides

log = logging.getLogger("mineonline")


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TrialRun(Trainable):
    """A mineonline run as a Tune trainable; see the module doc."""

    def setup(self, config: dict, spec: TrialSpec | None = None) -> None:
        assert spec is not None, "tune() binds the spec with tune.with_parameters"
        self.spec = spec
        os.chdir(spec.cwd)  # Tune starts trials in their trial directory; relative paths mean the user's
        # The name Tune gave the trial from its first parameters: PBT's new values keep the trial's run directory.
        self.name = self.trial_name
        self.run_dir = Path(spec.experiment_dir) / self.name
        self._events: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restore_from: str | None = None
        self._reported = 0.0  # the last iteration handed to Tune
        self._offset = 0  # how far metrics.jsonl has been read
        self._running: dict[str, float] = {}  # the latest value of every metric, as of the records read

    # -- Tune's calls ------------------------------------------------------------------------------

    def step(self) -> dict:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mineonline-trial", daemon=True)
            self._thread.start()
        kind, payload = self._events.get()
        # Tune takes one result per step(): when the run got ahead of it, the older results go, so that a
        # scheduler decides on the run's current numbers, never on a queue of past iterations.
        while kind == "result":
            try:
                kind, payload = self._events.get_nowait()
            except queue.Empty:
                break
        if kind == "error":
            raise payload
        if kind == "end":
            self._on_latest({})  # the records of a run that ended between two of its monitor's calls
            summary = _numbers(payload.get("summary") or {})
            iteration = max(float(payload.get("iteration", 0)), self._running.get("trainer/iteration", 0.0))
            final = {**self._running, **summary, "trainer/iteration": iteration}
            if self.spec.metric not in final:  # Tune would end the whole sweep on this result
                raise RunFailedError(
                    f"run {self.name} ended after {iteration:g} iterations and {final.get('env_steps', 0):g} env "
                    f"steps without logging {self.spec.metric}, the sweep's metric, so the trial cannot be ranked "
                    "(an episode/* metric needs a finished episode). Fix: longer trials "
                    "(train_config.num_iterations), or --metric naming a metric its runs log"
                )
            return {**final, "run_status": payload.get("status", "completed"), "done": True}
        return payload

    def cleanup(self) -> None:
        """A scheduler's stop, the experiment's end or Ctrl-C: the run stops as after Ctrl-C, then returns."""
        self._stop.set()
        if self._thread is not None:
            _request_stop(self.name)
            self._thread.join()

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """PBT's checkpoint of a trial: its run's latest checkpoint, linked (or copied) into Tune's directory,
        so that the run's own retention (``keep_interval``) cannot delete what another trial will clone."""
        from mineonline_core.trainer.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.run_dir / "checkpoints")
        if latest is not None:
            shutil.copytree(latest, Path(checkpoint_dir) / latest.name, copy_function=_link_or_copy)

    def load_checkpoint(self, checkpoint: str) -> None:
        found = sorted(Path(checkpoint).glob("checkpoint_*"))
        self._restore_from = str(found[-1]) if found else None

    # -- the run ----------------------------------------------------------------------------------

    def _on_latest(self, latest: dict) -> bool:
        """The run's monitor: queue a result per new iteration; True (stop the run) once Tune stopped the trial."""
        from mineonline_core.builtin.console import METRICS_FILE

        path = self.run_dir / METRICS_FILE
        if path.is_file():
            with path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line being written is read on the next call
            self._offset += len(whole)
            for line in whole.decode().splitlines():
                record = json.loads(line)
                values = _numbers(record)
                values.pop("time", None)
                values["env_steps"] = values.pop("step", self._running.get("env_steps", 0.0))
                self._running.update(values)
                iteration = record.get("trainer/iteration")
                if iteration is not None and iteration > self._reported and self.spec.metric in self._running:
                    self._reported = float(iteration)
                    self._events.put(("result", dict(self._running)))
        return self._stop.is_set()

    def _run(self) -> None:
        from mineonline_core.driver.api import run
        from mineonline_core.driver.rundir import RUN_FILE

        spec, own = self.spec, trial_overrides(self.spec, self.config)
        plumbing = [f"run_name={self.name}", f"output_dir={spec.experiment_dir}"]
        has_checkpoint = any((self.run_dir / "checkpoints").glob("checkpoint_*"))
        try:
            if self._restore_from and (self.run_dir / RUN_FILE).is_file():
                # PBT: another trial's weights, this trial's (mutated) parameters, in this trial's run directory.
                result = run(
                    None,
                    [*own, f"train_config.resume={self._restore_from}"],
                    resume=str(self.run_dir),
                    force=True,
                    progress=False,
                    quiet=True,
                    monitor=self._on_latest,
                )
            elif self._restore_from:
                result = run(
                    spec.source,
                    [*spec.fixed, *own, *plumbing, f"train_config.resume={self._restore_from}"],
                    progress=False,
                    quiet=True,
                    monitor=self._on_latest,
                )
            elif has_checkpoint:  # `mineonline tune --resume`: the trial continues where its run stopped
                result = run(None, [], resume=str(self.run_dir), progress=False, quiet=True, monitor=self._on_latest)
            else:
                result = run(
                    spec.source, [*spec.fixed, *own, *plumbing], progress=False, quiet=True, monitor=self._on_latest
                )
            if result.get("status") == "failed":
                raise RunFailedError(f"run {self.name} failed: see {self.run_dir / 'run.log'}")
            self._events.put(("end", result))
        except BaseException as exc:  # noqa: BLE001 - becomes the trial's error, raised by step() on Tune's thread
            log.error("trial %s failed: %s: %s", self.name, type(exc).__name__, exc)
            self._events.put(("error", RunFailedError(f"{type(exc).__name__}: {last_line(exc)}")))


def _request_stop(run_name: str) -> None:
    """Ask the run's rollout manager to stop now, as the run's monitor would at its next call (up to a second
    later, several CartPole iterations): the trainer stops after the iteration it is in."""
    import ray

    from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name

    try:
        manager = ray.get_actor(actor_name(run_name, ROLLOUT_MANAGER), namespace=NAMESPACE)
        ray.get(manager.request_stop.remote(), timeout=30)
    except Exception:  # noqa: BLE001 - a run not started yet or already ended stops through the monitor's flag
        log.debug("trial %s: no rollout manager to ask to stop", run_name, exc_info=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # checkpoint files are written once, never modified in place
    except OSError:
        shutil.copy2(src, dst)
