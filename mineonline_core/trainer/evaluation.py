"""Rank 0's side of evaluation while training: when to evaluate, on which weights, and the best checkpoint.

Every ``eval_interval`` iterations rank 0 hands the weights of that iteration to the ``Evaluator``
actor (``services/evaluator.py``) and goes on training: it never waits for an evaluation. The
weights are the object the broadcast thread already put for the rollout workers (``weights_sent``;
an iteration that publishes no version, such as PPO's value warm-up, puts its own). At most one
evaluation runs at a time; one that comes due while another runs is skipped, logged and counted
in ``eval/skipped``; one that fails (its env raised, its actor died) is logged with its cause and
counted in ``eval/failed``, and training goes on. A dead evaluator is replaced under a name of its own
(``..._r1``, ``_r2``: the GCS can still hold the dead one's name), said on the console and counted in
``eval/restarts``; a replacement that cannot start ends the run with both causes.

``keep_best_metric: eval/return_mean`` judges ``keep_best`` by the evaluations: when an evaluation
is handed over, rank 0 also writes the checkpoint of that iteration under
``<save_path>/eval_candidate/``; when its result arrives (checked once per iteration, without
waiting), the candidate either replaces the one in ``<save_path>/best/`` or is deleted, so the
checkpoint kept holds exactly the weights that were evaluated. At the end of training rank 0 waits
for the evaluation still running (not after a Ctrl-C or ``mineonline stop``), so the last one is
logged and judged too.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import TYPE_CHECKING, Callable

import ray

from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.services.names import EVALUATOR, NAMESPACE, actor_name
from mineonline_core.services.weights import pack_state
from mineonline_core.trainer.goals import BEST_DIR, replace_best
from mineonline_core.trainer.sequence import unwrap

if TYPE_CHECKING:
    import numpy as np
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from mineonline_core.services.evaluator import Evaluator
    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)

CANDIDATE_DIR = "eval_candidate"


class EvaluationClient:
    """The evaluator actor's handle and the one evaluation handed to it (thread-safe: the broadcast
    thread reports the weights it put, the trainer's thread asks for evaluations and their results)."""

    def __init__(
        self, *, start: Callable[[int], ActorHandle[Evaluator]], logger_hub: ActorHandle[LoggerHub] | None
    ) -> None:
        """``start(n)``: the evaluator actor, the ``n``-th replacement of the first (0)."""
        self._start, self.hub = start, logger_hub
        self.restarts = 0
        self.actor = start(0)
        self._lock = threading.Lock()
        # (version, ref) of the broadcast's latest put
        self._sent: tuple[int, ObjectRef[dict[str, np.ndarray]]] | None = None
        self._waiting: dict[str, int] | None = None  # a request whose weights the broadcast has not put yet
        self._running: tuple[dict[str, int], ObjectRef[dict[str, float]]] | None = None  # (request, result ref)
        self.skipped = self.failed = 0

    @property
    def busy(self) -> dict[str, int] | None:
        """The request being evaluated (or waiting for its weights), if any."""
        with self._lock:
            return self._waiting or (self._running[0] if self._running else None)

    def weights_sent(self, version: int, ref: ObjectRef[dict[str, np.ndarray]]) -> None:
        """The broadcast thread put the weights of ``version``: a request waiting for them starts."""
        with self._lock:
            self._sent = (version, ref)
            self._start_waiting()

    def request(
        self, *, iteration: int, version: int, env_steps: int, weights: ObjectRef[dict[str, np.ndarray]] | None = None
    ) -> bool:
        """Evaluate iteration ``iteration`` (model ``version``); ``weights``: its own put when the
        iteration published no version. False (skipped, logged, counted) while another one runs."""
        running = self.busy
        if running is not None:
            self.skipped += 1
            first = self.skipped == 1
            (log.warning if first else log.info)(
                "evaluation of iteration %d skipped: the evaluation of iteration %d is still running%s "
                "(eval/skipped: %d)",
                iteration,
                running["iteration"],
                "; train_config.eval_interval is shorter than one evaluation, or eval_episodes too many"
                if first
                else "",
                self.skipped,
            )
            self._log({"eval/skipped": float(self.skipped)}, env_steps)
            return False
        with self._lock:
            self._waiting = {"iteration": iteration, "version": version, "env_steps": env_steps}
            if weights is not None:
                self._sent = (version, weights)
            self._start_waiting()
        return True

    def _start_waiting(self) -> None:
        """Under the lock: hand the waiting request over once its version's weights are put."""
        if self._waiting is None or self._sent is None or self._sent[0] != self._waiting["version"]:
            return
        request, self._waiting = self._waiting, None
        self._running = (request, self.actor.evaluate.remote(self._sent[1], **request))

    def poll(self, *, wait: bool = False) -> list[tuple[dict[str, int], dict[str, float]]]:
        """The finished evaluation as ``[(request, eval metrics)]`` (``[]`` while it runs); a failed
        one is logged and counted. ``wait``: block until the evaluation handed over finishes."""
        with self._lock:
            running = self._running
        if running is None:
            return []
        request, ref = running
        ready, _ = ray.wait([ref], timeout=None if wait else 0)
        if not ready:
            return []
        with self._lock:
            self._running = None
        try:
            return [(request, ray.get(ref))]
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.failed += 1
            cause = last_line(exc)
            log.warning(
                "evaluation of iteration %d failed: %s (eval/failed: %d); training goes on",
                request["iteration"],
                cause,
                self.failed,
            )
            self._log({"eval/failed": float(self.failed)}, request["env_steps"])
            if isinstance(exc, ray.exceptions.RayActorError):  # its process died: the next evaluation gets a new one
                self._replace(cause, request["env_steps"])
            return []

    def _replace(self, cause: str, step: int) -> None:
        self.restarts += 1
        log.warning("the evaluator actor died (%s); starting replacement %d (eval/restarts)", cause, self.restarts)
        self._log({"eval/restarts": float(self.restarts)}, step)
        try:
            self.actor = self._start(self.restarts)
        except Exception as exc:  # noqa: BLE001 - reported with the death that led to it
            raise RunFailedError(
                f"The evaluator actor died ({cause}) and its replacement {self.restarts} could not start: "
                f"{type(exc).__name__}: {last_line(exc)}. Set train_config.eval_interval: 0 to train without "
                "evaluation, or resume the run."
            ) from exc

    def abandon(self, why: str) -> None:
        """Drop the evaluation handed over (not waited for), saying so and counting it as skipped."""
        request = self.busy
        if request is not None:
            self.skipped += 1
            log.warning(
                "evaluation of iteration %d abandoned: %s (eval/skipped: %d)", request["iteration"], why, self.skipped
            )
            self._log({"eval/skipped": float(self.skipped)}, request["env_steps"])

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.hub is not None:
            self.hub.log_metrics.remote(metrics, step)


class Evaluating:
    """``TrainLoop``'s evaluation while training (rank 0); see the module doc."""

    def start_evaluation(self) -> None:
        """Rank 0, before the first broadcast: start the evaluator actor when ``eval_interval`` is on."""
        if not self.train_config.eval_interval or self.rank != 0:
            return
        from mineonline_core.services.evaluator import start_evaluator
        from mineonline_core.config.generators import Deferred

        shutil.rmtree(self.save_dir / CANDIDATE_DIR, ignore_errors=True)  # a crashed run's candidate
        name = actor_name(str(self.config.run_name), EVALUATOR, self.restarts)
        kwargs = {
            "namespace": NAMESPACE,
            "config": self.config,
            "policy_generator": Deferred(self.policy_generator),
            "env_generator": Deferred(self.env_generator),
            "logger_hub": self.logger_hub,
        }
        self._evaluation = EvaluationClient(
            start=lambda n: start_evaluator(name=f"{name}_r{n}" if n else name, **kwargs), logger_hub=self.logger_hub
        )

    def evaluate_iteration(self, *, published: bool) -> None:
        """Rank 0, after the iteration's metrics were logged: judge a finished evaluation, hand this
        iteration over when one is due (``published``: its weights went out with the broadcast)."""
        client = self._evaluation
        if client is None:
            return
        for request, metrics in client.poll():
            self._judge_evaluation(request, metrics)
        if self.iteration % self.train_config.eval_interval:
            return
        weights = (
            None if published else ray.put(pack_state(unwrap(self.model).state_dict()))  # bf16 and fp16 parameters too
        )
        if client.request(iteration=self.iteration, version=self.version, env_steps=self.env_steps, weights=weights):
            if self.goals.judges_by_eval:
                self._write_checkpoint(self.save_dir / CANDIDATE_DIR, keep_interval=None)

    def finish_evaluation(self) -> None:
        """Rank 0, after the last iteration: wait for the evaluation still running (unless the run was
        stopped by hand), judge it, then end the evaluator actor."""
        client, self._evaluation = self._evaluation, None
        if client is None:
            return
        stopped_by_hand = bool(self.last_metrics.get("trainer/stopped_early")) and self._goal_reached is None
        if stopped_by_hand:
            client.abandon("the run was stopped before it finished")
        else:
            if client.busy is not None:
                log.info("waiting for the evaluation of iteration %d to finish", client.busy["iteration"])
            for request, metrics in client.poll(wait=True):
                self._judge_evaluation(request, metrics)
        ray.kill(client.actor)
        shutil.rmtree(self.save_dir / CANDIDATE_DIR, ignore_errors=True)

    def _judge_evaluation(self, request: dict[str, int], metrics: dict[str, float]) -> None:
        """Promote the evaluated iteration's candidate to ``best/`` when its return is the best so far."""
        if not self.goals.judges_by_eval:
            return
        candidate = self.save_dir / CANDIDATE_DIR / f"checkpoint_{request['iteration']:06d}"
        value = self.goals.improved_value(metrics[self.goals.metric])
        if value is None or not candidate.is_dir():
            shutil.rmtree(candidate, ignore_errors=True)
            return
        root = self.save_dir / BEST_DIR
        root.mkdir(parents=True, exist_ok=True)
        kept = root / candidate.name
        shutil.rmtree(kept, ignore_errors=True)
        os.replace(candidate, kept)
        record = {
            "iteration": request["iteration"],
            "model_version": request["version"],
            "env_steps": request["env_steps"],
        }
        replace_best(root, kept, {**record, self.goals.metric: value})
