"""Evaluation while training: the actor that plays whole episodes with the weights of one iteration.

``train_config.eval_interval`` turns it on. Rank 0 of the trainer starts one ``Evaluator`` actor
(``{run}/evaluator_{restart}``, reserving ``eval_num_cpus`` and ``eval_num_gpus``, counted in the
run's resource check) and, every ``eval_interval`` iterations, hands it the weights of that
iteration (``trainer/evaluation.py``). The actor does what ``mineonline eval`` does for a checkpoint
(``driver/evaluate.py``): ``eval_episodes`` whole episodes in the run's env, adapted as in
rollout, with the most likely action (``eval_deterministic``) or sampled ones, in float32, with
Crafter's score and MineStudio's reward events. Episode ``i`` resets with seed
``seed + EVAL_SEED_OFFSET + i`` at every evaluation: held-out starts, the same for every iteration,
so two evaluations differ by the weights alone.

The actor logs its ``eval/*`` metrics to the logging actor itself, at the env steps of the
iteration it evaluated (the step that iteration's ``trainer/*`` metrics carry), so every logger
puts them on the training's step axis, whenever they arrive; it returns them to rank 0 too, which
judges ``keep_best`` by ``eval/return_mean`` with them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import ray
import torch

from mineonline_core.services.episodes import EVAL_SEED_OFFSET, LoadedPolicy, run_episode, summarize
from mineonline_core.services.runlog import setup_actor_logging
from mineonline_core.services.weights import WeightReceiver

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)

__all__ = ["EVAL_SEED_OFFSET", "Evaluator", "eval_metrics", "start_evaluator"]
_SUMMARY_KEYS = ("return_mean", "return_std", "return_min", "return_max", "length_mean", "episodes")


def eval_metrics(summary: dict[str, Any], *, iteration: int, version: int, wall_s: float) -> dict[str, float]:
    """``summarize``'s result as ``eval/*`` scalars: returns, length, Crafter's score and success
    rates, MineStudio's event counts per episode (``eval/events/kill_entity/cow``)."""
    out = {f"eval/{key}": float(summary[key]) for key in _SUMMARY_KEYS}
    out.update({"eval/iteration": float(iteration), "eval/model_version": float(version), "eval/wall_s": wall_s})
    crafter = summary.get("crafter")
    if crafter:
        out["eval/crafter/score"] = float(crafter["score"])
        out.update({f"eval/crafter/success/{name}": float(rate) for name, rate in crafter["success_rates"].items()})
    for name, count in summary.get("events_per_episode", {}).items():
        event, _, obj = name.partition(":")
        out[f"eval/events/{event}/{obj}"] = float(count)
    return out


class Evaluator:
    """Plays ``eval_episodes`` episodes per ``evaluate`` call; a Ray actor (see ``start_evaluator``)."""

    def __init__(
        self,
        *,
        policy_generator: Callable[[], torch.nn.Module],
        env_generator: Callable[[], Any],
        config: Any,
        logger_hub: ActorHandle[LoggerHub] | None = None,
    ) -> None:
        setup_actor_logging()
        train_config = config.train_config
        self.episodes, self.deterministic = train_config.eval_episodes, train_config.eval_deterministic
        self.seed, self.hub = int(config.seed) + EVAL_SEED_OFFSET, logger_hub
        torch.set_num_threads(max(1, int(train_config.eval_num_cpus)))
        on_gpu = (
            train_config.eval_num_gpus > 0
            and bool(ray.is_initialized() and ray.get_gpu_ids())
            and torch.cuda.is_available()
        )
        device = torch.device("cuda" if on_gpu else "cpu")
        policy = policy_generator().to(device).eval().requires_grad_(False)
        self.policy = LoadedPolicy(
            policy=policy, config=config, checkpoint=None, iteration=0, version=0, env_generator=env_generator
        )
        self.receiver = WeightReceiver(device=device)  # as rollout loads a version: bf16 and fp16 included
        self.env: Any = None  # built at the first evaluation, rebuilt after one that failed

    def evaluate(self, weights: dict[str, Any], *, iteration: int, version: int, env_steps: int) -> dict[str, float]:
        """Load ``weights`` (iteration ``iteration``'s state dict), play the episodes, log ``eval/*``
        at ``env_steps`` and return them. An env that raises fails this evaluation only."""
        started = time.perf_counter()
        self.receiver.load(self.policy.policy, weights, version=version, what="the evaluator's policy")
        torch.manual_seed(self.seed)  # sampled actions are drawn alike at every evaluation
        records = []
        try:
            if self.env is None:
                self.env = self.policy.make_env()
            for i in range(self.episodes):
                records.append(
                    run_episode(
                        self.policy, self.env, deterministic=self.deterministic, seed=self.seed + i, record=False
                    )
                )
        except BaseException:
            self._close_env()  # the next evaluation starts from a fresh env
            raise
        metrics = eval_metrics(
            summarize(records), iteration=iteration, version=version, wall_s=time.perf_counter() - started
        )
        if self.hub is not None:
            # Waited for: the trainer kills this actor right after the last evaluation returns, which
            # would drop a call still queued here (the run's last eval/* missing from every logger).
            try:
                ray.get(self.hub.log_metrics.remote(metrics, env_steps), timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("the logging actor did not take iteration %d's eval metrics: %s", iteration, exc)
        return metrics

    def _close_env(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a broken env's close must not hide why it broke
                pass


def start_evaluator(*, name: str, namespace: str, config: Any, **kwargs: Any) -> ActorHandle[Evaluator]:
    """The ``Evaluator`` actor ``name``, reserving ``eval_num_cpus`` and ``eval_num_gpus``. Ray does
    not restart it (its constructor's arguments live in the object store); rank 0 starts a new one
    when it died (``EvaluationClient.poll``)."""
    train_config = config.train_config
    actor_cls = ray.remote(num_cpus=train_config.eval_num_cpus, num_gpus=train_config.eval_num_gpus)(Evaluator)
    return actor_cls.options(name=name, namespace=namespace).remote(config=config, **kwargs)
