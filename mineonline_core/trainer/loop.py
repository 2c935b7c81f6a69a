"""``TrainLoop``: the distributed loop around an ``Algorithm``'s loss; the core's, never subclassed by plugins.

Glossary: an **iteration** fetches ``batches_per_iteration * batch_size_per_gpu`` chunks per rank,
estimates advantages with the current model (the algorithm's ``estimate``), runs the update loop
(``train``, ``trainer/update.py``) over the algorithm's ``compute_loss``, bumps the **model version**
and broadcasts the weights to the rollout workers. **Staleness** of a step is the current version
minus the version that chose its action.

The loop runs on ``train_config.num_workers`` Ray Train ranks (``TorchTrainer``; gloo on CPU, NCCL on
GPU), or, for one rank, in the driver's own process (``train_config.use_ray_train``), on its CPU or
on the GPU share it leases from Ray (``trainer/device.py``): the same ``_train_func``, without Ray
Train's seconds of start-up nor a process group for a world of one. The loop is pickled to each rank
with its algorithm, so it holds only handles and config until ``_train_func`` builds the live model
there (``_LIVE``: what is dropped from the pickle).

What the loop does, and where: ``fetch.py`` (chunks, prefetching, the estimate step), ``update.py``
(epochs, micro-batches, BPTT windows, accumulation, AMP, clipping), ``publish.py`` (broadcasts, metric
logging, checkpoints), ``evaluation.py`` and ``goals.py`` (evaluation, best checkpoint, stop criteria),
``build.py`` (the policy and the KL reference) and ``ranks.py`` (``fit``: Ray Train or this process).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import ray
import torch
from pydantic import BaseModel
from torch import nn

from mineonline_core.config.checks import ignored_key_warnings
from mineonline_core.contracts import fragment as F
from mineonline_core.config.messages import validate_trainer_options
from mineonline_core.config.secrets import public_config, redact_text
from mineonline_core.errors import SampleStopped
from mineonline_core.services.finite import UpdateGuard
from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.services.runlog import setup_actor_logging
from mineonline_core.trainer import recovery
from mineonline_core.trainer.build import PolicyBuilding
from mineonline_core.trainer.algorithm import Algorithm, TrainContext
from mineonline_core.trainer.device import indexed_device
from mineonline_core.trainer.ranks import DriverSide
from mineonline_core.trainer.evaluation import Evaluating
from mineonline_core.trainer.fetch import ChunkFetching, OrderedWorker
from mineonline_core.trainer.goals import Goals
from mineonline_core.trainer.publish import Publishing
from mineonline_core.trainer.update import UpdateLoop

log = logging.getLogger(__name__)
if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.services.handles import RolloutManagerHandle, WeightReceiverHandle
    from mineonline_core.services.heartbeat import HeartbeatBoard
    from mineonline_core.services.loggerhub import LoggerHub

_LIVE = (
    "model",
    "policy",
    "optimizer",
    "scaler",
    "_buffer",
    "_store",
    "_workers",
    "_pending_release",
    "_prefetch",
    "_fetcher",
    "reference",
    "_reference_ref",
    "update_guard",
    "_broadcaster",
    "_broadcast",
    "_snapshot",
    "_evaluation",
    "_built",
    "_pristine",
)


class TrainLoop(DriverSide, PolicyBuilding, ChunkFetching, UpdateLoop, Publishing, Evaluating):
    """Fetch, estimate, update, publish, checkpoint, evaluate: around ``algorithm``'s hooks (see the module doc).

    ``algorithm``: an ``Algorithm`` subclass, built here with its options (``options``, else validated
    from ``config.train_config``), or an instance."""

    def __init__(
        self,
        *,
        algorithm: Algorithm | type[Algorithm],
        rollout_manager: RolloutManagerHandle | None,
        policy_generator: Callable[[], nn.Module],
        env_generator: Callable[[], Any],
        config: Any,
        run_dir: str,
        logger_hub: ActorHandle[LoggerHub] | None = None,
        whole_config: str | None = None,
        saved_config: dict | None = None,
        options: BaseModel | None = None,
    ) -> None:
        self.rollout_manager, self.logger_hub = rollout_manager, logger_hub
        self.policy_generator, self.env_generator = policy_generator, env_generator
        self.config, self.train_config = config, config.train_config
        if isinstance(algorithm, type):
            # The algorithm's own train_config keys, validated against its Config (resolve() passes them).
            valid = options if options is not None else validate_trainer_options(algorithm, self.train_config)
            algorithm = algorithm(options=valid)
        self.algorithm, self.options = algorithm, algorithm.options
        algorithm.ctx = TrainContext(self)
        self.run_dir = str(Path(run_dir).expanduser().resolve())
        self.save_dir = ckpt.resolve_save_path(self.train_config.save_path, self.run_dir)
        # MineStudio's whole_config is the config file's text; checkpoints keep it beside the resolved
        # config (saved_config: what the driver writes as the run's config.yaml, what a resume compares
        # against, what rebuilds the run). Neither ever holds a secret.
        self.whole_config = redact_text(whole_config) if whole_config is not None else None
        self.saved_config = saved_config if saved_config is not None else public_config(config)
        # Live, per-rank state; built by setup_rank() on the rank, never pickled.
        self.model: nn.Module | None = None  # what forward/backward go through (DDP-wrapped when world > 1)
        self.policy: nn.Module | None = None  # the bare policy (heads, value normaliser)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = None
        self.update_guard: UpdateGuard | None = None  # skips optimiser steps with non-finite values
        self._buffer = self._store = self._pending_release = None
        # The rollout workers' handles (rank 0), for broadcasts without the manager's hop.
        self._workers: list[WeightReceiverHandle] = []
        self._prefetch: deque[tuple[int, int, Future]] = deque()  # (iteration, num_chunks, its batch)
        self.corrupt_fragments = 0  # refused fragments, each counted once (trainer/fetch.py)
        self.corrupt_records = 0  # records the store could not decode
        self._refused_keys: set[str] = set()  # a refused chunk is served again until used up
        # A KL reference policy, if the algorithm has one: rollout runs it beside the behaviour
        # policy so that each fragment records the reference's own recurrent state at its start.
        self.reference: nn.Module | None = None
        self._reference_ref: Any = None  # the reference's weights in the object store (the broadcast thread's)
        self._reference_stale = True  # the next broadcast sends the reference's weights (trainer thread)
        self._broadcaster: OrderedWorker | None = None  # the broadcast thread (trainer/publish.py)
        self._broadcast: tuple[int, Future] | None = None  # (version, its send) in flight
        self._snapshot: Any = None  # the weights' buffers on this rank's device, reused by every broadcast
        self._fetcher: OrderedWorker | None = None
        self._evaluation: Any = None  # rank 0's EvaluationClient when eval_interval is on (trainer/evaluation.py)
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.in_process = False  # True while fit() runs the loop in this process instead of Ray Train
        self.iteration, self.version = 0, 0
        self._fit_started: float | None = None  # set by fit(): checkpoints written since are this run's
        self.restarts = 0  # times fit() restarted the ranks after one died
        # The ranks' HeartbeatBoard while fit() runs Ray Train.
        self._heartbeats: ActorHandle[HeartbeatBoard] | None = None
        self.rank_hangs = 0  # of those restarts, the ones of a rank killed as hung
        self.env_steps = 0  # the run's env-step count when this iteration was logged (rank 0)
        self.learning_rate = self.train_config.learning_rate
        self.perf: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}
        self.goals = Goals(config)  # max_env_steps, stop_at_return, keep_best (rank 0 judges)
        self._goal_reached: str | None = None
        self._built = self._pristine = None  # trainer/build.py

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in _LIVE:
            state[key] = None
        state["_prefetch"] = deque()
        state["_reference_stale"] = True
        return state

    # -- schedules ------------------------------------------------------------------------------

    def learning_rate_at(self, iteration: int) -> float:
        train_config = self.train_config
        if not train_config.anneal_lr_linearly:
            return train_config.learning_rate
        return train_config.learning_rate * (1.0 - (iteration - 1) / train_config.num_iterations)

    def apply_optimizer_settings(self, optimizer: torch.optim.Optimizer, iteration: int) -> None:
        """Set the config's learning rate (at ``iteration``), weight decay and epsilon on every param
        group that has them: called after an optimiser state is loaded on resume."""
        train_config = self.train_config
        values = {
            "lr": self.learning_rate_at(iteration),
            "weight_decay": train_config.weight_decay,
            "eps": train_config.adam_eps,
        }
        for group in optimizer.param_groups:
            for key, value in values.items():
                if key in group:
                    group[key] = value
                    if key == "lr" and "initial_lr" in group:
                        group["initial_lr"] = train_config.learning_rate

    # -- driver side ----------------------------------------------------------------------------

    def preflight(self) -> None:
        """Errors a user can fix, raised before any training starts (and the trainer's own keys
        that have no effect, warned about)."""
        for message in ignored_key_warnings(self.options):
            log.warning(message)
        ckpt.check_writable(self.save_dir)
        policy = self.preflight_policy()
        self.algorithm.check_policy(policy)  # on the driver, before any Ray Train worker starts
        if self.train_config.resume:
            state = ckpt.load_checkpoint(self.train_config.resume)
            ckpt.check_compatible(policy, state["model"], source=str(state["path"]))

    # -- rank side ------------------------------------------------------------------------------

    def setup_rank(self, *, local: bool = False, device: torch.device | None = None) -> None:
        """Build the policy, optimiser, DDP wrapper and AMP scaler on this rank (resuming if asked).

        ``local=True`` sets up a single rank outside Ray Train (the in-process trainer, tests) on
        ``device``: the CPU by default; ``fit`` passes the GPU the driver leased (``trainer/device.py``).
        """
        if local:
            self.rank, self.world_size, self.device = 0, 1, indexed_device(device or "cpu")
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # as Ray Train sets for its ranks: a bare "cuda" is this one
        else:
            import ray.train
            import ray.train.torch

            ctx = ray.train.get_context()
            self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
            self.device = indexed_device(ray.train.torch.get_device())
        train_config, seed = self.train_config, self.config.seed
        torch.manual_seed(seed)  # the same initial weights (and KL reference) on every rank
        self._reference_stale = True  # a rebuilt reference is sent with the first broadcast
        self.reference = None
        policy = self._initial_policy(local)
        self.algorithm.check_policy(policy)
        self.algorithm.init_policy(policy)
        own = recovery.own_checkpoint(self.save_dir, self._fit_started)  # this run's progress, after a restart
        resume = ckpt.load_checkpoint(own or train_config.resume) if (own or train_config.resume) else None
        if resume is not None:
            ckpt.check_compatible(policy, resume["model"], source=str(resume["path"]))
            policy.load_state_dict(resume["model"])
        policy.to(self.device)
        self.policy = policy
        # Built before the optimiser, from the copy of the policy as built (``trainer/build.py``).
        self.reference = self.make_reference() if self.algorithm.has_reference(self.options) else None
        model, self.optimizer = self.algorithm.setup_model_and_optimizer(policy)
        if self.world_size > 1:
            import ray.train.torch

            model = ray.train.torch.prepare_model(model, move_to_device=False)
        self.model = model
        precision = PrecisionChoice.from_config(train_config).on(self.device)  # raises for bfloat16 on a GPU without it
        precision.apply_tf32()  # explicit on every rank, as on every rollout worker
        self.scaler = precision.make_scaler()  # float16 on CUDA only
        self.update_guard = UpdateGuard(max_consecutive=train_config.max_skipped_updates)
        self._pristine = None  # a trainer whose setup took no reference leaves no copy behind
        _seed_everything(seed + 1000 * self.rank + 1)
        if resume is not None:
            self._restore(resume)

    def _restore(self, resume: dict[str, Any]) -> None:
        state = resume["trainer"]
        self.iteration, self.version = int(state["iteration"]), int(state["version"])
        self.env_steps = int(state.get("env_steps", 0))
        self.goals.best_return = state.get("best_return")
        if self.train_config.resume_optimizer:
            self.optimizer.load_state_dict(resume["optimizer"])
            # The loaded state carries the checkpoint's hyperparameters; the config's win.
            self.apply_optimizer_settings(self.optimizer, self.iteration + 1)
            if resume["scaler"] and self.scaler.is_enabled():
                self.scaler.load_state_dict(resume["scaler"])
        ckpt.set_rng_state(state["rng"])  # rank 0's generators; the other ranks re-derive their own
        if self.rank > 0:
            _seed_everything(self.config.seed + 1000 * self.rank + 1 + self.iteration)
        self.algorithm.load_trainer_state(state.get("extra", {}))

    def _train_func(self) -> None:
        # No parameter: Ray Train passes its config to a loop function that takes one.
        setup_actor_logging()  # a Ray Train rank is an actor; in the driver's process this does nothing
        self._start_beat()  # a Ray Train rank's heartbeat, from before its setup (trainer/ranks.py)
        self.setup_rank(local=self.in_process, device=self.device if self.in_process else None)
        self._connect()
        self.rewind_logs()
        self.version = recovery.rejoin_version(self.rollout_manager, self.version)
        if self.rank == 0:
            self._publish_weights()  # rollout waits for the first weights
        train_config = self.train_config
        start = self.iteration
        for iteration in range(self.iteration + 1, train_config.num_iterations + 1):
            try:
                self.run_iteration(iteration)
            except SampleStopped:
                # Asked to stop while waiting for this iteration's chunks: the one before it is final. It
                # is saved unless a checkpoint of it exists (the resumed one, or a save_interval multiple).
                self.iteration = iteration - 1
                if self.iteration == 0 or (
                    self.iteration != start and self.iteration % train_config.save_interval != 0
                ):
                    self.save_checkpoint()
                self.last_metrics["trainer/stopped_early"] = 1.0
                break
            if iteration < train_config.num_iterations and self._stop_requested():
                # Ctrl-C, `mineonline stop` or a goal reached: leave a checkpoint of the last finished iteration.
                if iteration % train_config.save_interval != 0:
                    self.save_checkpoint()
                self.last_metrics["trainer/stopped_early"] = 1.0
                break
        self.flush_broadcast()  # the last version reaches the rollout side before training ends
        self.finish_evaluation()
        if not self.in_process:
            import ray.train

            ray.train.report(dict(self.last_metrics))

    def _stop_requested(self) -> bool:
        """Rank 0 asks the manager; every rank gets the same answer so that all stop together."""
        flag = float(self._goal_reached is not None)
        if self.rank == 0 and not flag and hasattr(self.rollout_manager, "stop_requested"):
            flag = float(ray.get(self.rollout_manager.stop_requested.remote()))
        if self.world_size > 1:
            import torch.distributed as dist

            tensor = torch.tensor([flag], device=self.device)
            dist.broadcast(tensor, src=0)
            flag = float(tensor[0])
        return flag > 0

    def _connect(self) -> None:
        manager = self.rollout_manager
        self._buffer, self._store = ray.get([manager.get_buffer.remote(), manager.get_store_client.remote()])
        if self.rank == 0:
            self._workers = ray.get(manager.weight_receivers.remote())  # the workers, or the shared inference server
            self.start_evaluation()

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """One iteration, as named steps on every rank; rank 0 alone logs, evaluates and judges goals."""
        train_config = self.train_config
        self.start_iteration(iteration)
        batch = self.fetch_fragments_and_estimate_advantages(
            train_config.batches_per_iteration * train_config.batch_size_per_gpu
        )
        with self.timed("perf/train_ms"):
            metrics = {**self.train(batch), **self.algorithm.iteration_metrics()}
        with self.timed("perf/broadcast_ms"):
            published = self.publish_version(iteration)
        metrics = self.last_metrics = {**metrics, **self.loop_metrics(batch)}
        if self.rank == 0:
            self.log_and_evaluate(metrics, batch, published=published)
        if iteration % train_config.save_interval == 0 or iteration == train_config.num_iterations:
            self.save_checkpoint()
        if self.rank == 0:
            self.judge_goals()
        return metrics

    # -- the iteration's steps --------------------------------------------------------------------

    def start_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.learning_rate = self.learning_rate_at(iteration)
        self.update_guard.skipped_iteration = 0
        self.check_broadcast()  # the previous broadcast's failure, if it already failed

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """``perf[key]``: the milliseconds the block took."""
        start = time.perf_counter()
        yield
        self.perf[key] = 1e3 * (time.perf_counter() - start)

    def publish_version(self, iteration: int) -> bool:
        """Bump the version and broadcast the weights when the algorithm publishes this iteration."""
        published = self.algorithm.publishes_version(iteration)
        if published:
            self.broadcast_model_to_rollout_workers(new_version=True)
        return published

    def loop_metrics(self, batch: dict[str, Any]) -> dict[str, float]:
        """The loop's own metrics of the iteration just trained: timings, version, throughput, guards."""
        train_config = self.train_config
        steps = batch["reward"].numel() * self.world_size * train_config.epochs_per_iteration
        return {
            **self.perf,
            "trainer/iteration": self.iteration,
            "trainer/version": self.version,
            "trainer/learning_rate": self.learning_rate,
            "trainer/samples_per_s": steps / max(self.perf["perf/train_ms"] / 1e3, 1e-9),
            "trainer/staleness_mean": float(batch[F.STALENESS].mean()),
            "trainer/skipped_updates": float(self.update_guard.skipped_iteration),
            "trainer/skipped_updates_total": float(self.update_guard.skipped_total),
            "trainer/restarts": float(self.restarts),
            "trainer/rank_hangs": float(self.rank_hangs),
        }

    def log_and_evaluate(self, metrics: dict[str, float], batch: dict[str, Any], *, published: bool) -> None:
        """Rank 0: log the iteration, hand it to the evaluator when due, ask for videos when due."""
        train_config = self.train_config
        self._log(metrics, batch)
        self.evaluate_iteration(published=published)
        if train_config.record_video_interval and self.iteration % train_config.record_video_interval == 0:
            self.rollout_manager.record_videos.remote()

    def judge_goals(self) -> None:
        """Rank 0: keep a new best checkpoint, note a reached stop criterion (``trainer/publish.py``)."""
        if self.goals.active and self.logger_hub is not None:
            self._judge_goals(ray.get(self.logger_hub.latest.remote()))


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
