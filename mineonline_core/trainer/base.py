"""``BaseTrainer``: the distributed loop around an algorithm's ``train(batch)``.

Glossary (DESIGN §4): an **iteration** fetches ``batches_per_iteration * batch_size_per_gpu`` chunks
per rank, estimates advantages with the current model, calls ``train`` once, bumps the **model
version** and broadcasts the weights to the rollout workers. **Staleness** of a step is the current
version minus the version that chose its action.

The loop runs on ``train_config.num_workers`` Ray Train ranks (``TorchTrainer``; gloo on CPU, NCCL on
GPU), or, for one CPU rank, in the driver's own process (``train_config.use_ray_train``): the same
``_train_func``, without Ray Train's seconds of start-up. The trainer object is pickled to each rank,
so it holds only handles and config until ``_train_func`` builds the live model there. Subclasses
implement ``setup_model_and_optimizer`` and ``train`` (MineStudio's names) and may persist extra
state through ``trainer_state`` / ``load_trainer_state``; everything else (fetching, GAE, broadcast, checkpoints, metrics) lives here.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import ray
import torch
import yaml
from pydantic import BaseModel, ConfigDict
from torch import nn

from mineonline_core.errors import RunFailedError, find_user_error
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages
from mineonline_core.trainer.sequence import unwrap

_LIVE = ("model", "policy", "optimizer", "scaler", "_buffer", "_store", "_workers", "_pending_release", "_prefetch",
         "_fetcher")


class TrainerOptions(BaseModel):
    """Trainer-specific options; the base trainer has none."""

    model_config = ConfigDict(extra="forbid")


class BaseTrainer:
    """Subclass, set ``name``, implement ``setup_model_and_optimizer`` and ``train``."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = TrainerOptions

    def __init__(self, *, rollout_manager: Any, policy_generator: Callable[[], nn.Module], env_generator: Callable[[], Any],
                 config: Any, run_dir: str, logger_hub: Any = None, whole_config: str | None = None) -> None:  # fmt: skip
        self.rollout_manager, self.logger_hub = rollout_manager, logger_hub
        self.policy_generator, self.env_generator = policy_generator, env_generator
        self.config, self.train_config = config, config.train_config
        self.run_dir = str(Path(run_dir).expanduser().resolve())
        self.save_dir = ckpt.resolve_save_path(self.train_config.save_path, self.run_dir)
        self.whole_config = whole_config if whole_config is not None else yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
        # Live, per-rank state; built by setup_rank() on the rank, never pickled.
        self.model: nn.Module | None = None  # what forward/backward go through (DDP-wrapped when world > 1)
        self.policy: nn.Module | None = None  # the bare policy (heads, value normaliser)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scaler: Any = None
        self._buffer = self._store = self._pending_release = None
        self._workers: list = []  # rollout worker handles (rank 0), for broadcasts without the manager's hop
        self._prefetch: tuple[int, Future] | None = None  # (num_chunks, the next iteration's batch)
        self._fetcher: _Fetcher | None = None
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.in_process = False  # True while fit() runs the loop in this process instead of Ray Train
        self.iteration, self.version = 0, 0
        self.learning_rate, self.rho = self.train_config.learning_rate, self.train_config.kl_divergence_coef_rho
        self.perf: dict[str, float] = {}
        self.last_metrics: dict[str, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in _LIVE:
            state[key] = None
        return state

    # -- to implement -------------------------------------------------------------------------

    def setup_model_and_optimizer(self, policy: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return the module to train (usually ``policy`` itself) and its optimiser."""
        raise NotImplementedError

    def train(self, batch: dict) -> dict[str, float]:
        """One iteration's optimisation on this rank's batch; returns scalar metrics."""
        raise NotImplementedError

    def trainer_state(self) -> dict[str, Any]:
        """Extra state to checkpoint (tensors, numbers, lists, dicts only)."""
        return {}

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what ``trainer_state`` returned."""

    def on_checkpoint(self, path: Path | None) -> None:
        """Called on every rank after a checkpoint of the current iteration was written."""

    # -- schedules ------------------------------------------------------------------------------

    def learning_rate_at(self, iteration: int) -> float:
        tc = self.train_config
        if not tc.anneal_lr_linearly:
            return tc.learning_rate
        return tc.learning_rate * (1.0 - (iteration - 1) / tc.num_iterations)

    def rho_at(self, iteration: int) -> float:
        tc = self.train_config
        return tc.kl_divergence_coef_rho * tc.coef_rho_decay ** (iteration - 1)

    # -- driver side ----------------------------------------------------------------------------

    def preflight(self) -> None:
        """Errors a user can fix, raised before any training starts."""
        ckpt.check_writable(self.save_dir)
        if self.train_config.resume:
            state = ckpt.load_checkpoint(self.train_config.resume)
            policy = self.policy_generator()
            ckpt.check_compatible(policy, state["model"], source=str(state["path"]))

    def uses_ray_train(self) -> bool:
        """Ray Train for several ranks or GPUs (or when asked); otherwise the driver's process."""
        tc = self.train_config
        if tc.use_ray_train is not None:
            return tc.use_ray_train
        return tc.num_workers > 1 or tc.num_gpus_per_worker > 0

    def fit(self) -> dict:
        """Run every iteration, on Ray Train ranks or in this process; return the final metrics."""
        self.preflight()
        if not self.uses_ray_train():
            return self._fit_in_process()
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        tc = self.train_config
        use_gpu = tc.num_gpus_per_worker > 0
        resources = {"CPU": tc.num_cpus_per_worker, **({"GPU": tc.num_gpus_per_worker} if use_gpu else {})}
        trainer = TorchTrainer(
            self._train_func,
            scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            run_config=RunConfig(storage_path=str(Path(self.run_dir) / "ray_train"), name="train"),
        )
        try:
            result = trainer.fit()
        except Exception as exc:
            raise find_user_error(exc) or RunFailedError(f"Training failed on a Ray Train worker: {exc}") from exc
        return self._final_metrics(result.metrics)

    def _fit_in_process(self) -> dict:
        """The single-rank loop in this process: what a Ray Train rank runs, without the seconds of
        start-up of its controller, placement group, worker group and process group."""
        threads = torch.get_num_threads()
        # As Ray Train gives a rank (OMP_NUM_THREADS): more threads than reserved CPUs spin
        # against the rollout workers for the same cores.
        torch.set_num_threads(max(1, int(self.train_config.num_cpus_per_worker)))
        self.in_process = True
        try:
            self._train_func()
        except Exception as exc:
            raise find_user_error(exc) or RunFailedError(f"Training failed: {type(exc).__name__}: {exc}") from exc
        finally:
            torch.set_num_threads(threads)
        return self._final_metrics(self.last_metrics)

    def _final_metrics(self, reported: dict | None) -> dict:
        """The last iteration's metrics plus ``iteration`` and ``version`` (the run's end point)."""
        # Ray Train v2 keeps metrics only alongside checkpoints; the hub has the latest of everything.
        metrics = dict(reported or {})
        if not metrics and self.logger_hub is not None:
            latest = ray.get(self.logger_hub.latest.remote())
            metrics = {k: v for k, v in latest.items() if k.startswith(("trainer/", "perf/"))}
        # Every run ends with a checkpoint of its last iteration: the authoritative end point (the
        # hub's copy of the last metrics may still be in flight).
        last = ckpt.latest_checkpoint(self.save_dir)
        if last is not None:
            state = torch.load(last / "trainer.pt", map_location="cpu", weights_only=True)
            metrics.update({"trainer/iteration": state["iteration"], "trainer/version": state["version"]})
        metrics["iteration"] = int(metrics.get("trainer/iteration", 0))
        metrics["version"] = int(metrics.get("trainer/version", 0))
        return metrics

    # -- rank side ------------------------------------------------------------------------------

    def setup_rank(self, *, local: bool = False) -> None:
        """Build the policy, optimiser, DDP wrapper and AMP scaler on this rank (resuming if asked).

        ``local=True`` sets up a single CPU rank outside Ray Train (the in-process trainer, tests).
        """
        if local:
            self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        else:
            import ray.train
            import ray.train.torch

            ctx = ray.train.get_context()
            self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
            self.device = ray.train.torch.get_device()
        tc, seed = self.train_config, int(getattr(self.config, "seed", 0) or 0)
        torch.manual_seed(seed)  # the same initial weights (and KL reference) on every rank
        policy = self.policy_generator()
        if tc.zero_initial_vf:
            policy.value_head.reset_parameters()
        resume = ckpt.load_checkpoint(tc.resume) if tc.resume else None
        if resume is not None:
            ckpt.check_compatible(policy, resume["model"], source=str(resume["path"]))
            policy.load_state_dict(resume["model"])
        policy.to(self.device)
        self.policy = policy
        model, self.optimizer = self.setup_model_and_optimizer(policy)
        if self.world_size > 1:
            import ray.train.torch

            model = ray.train.torch.prepare_model(model, move_to_device=False)
        self.model = model
        cuda_amp = tc.use_amp and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=cuda_amp)
        _seed_everything(seed + 1000 * self.rank + 1)
        if resume is not None:
            self._restore(resume)

    def _restore(self, resume: dict[str, Any]) -> None:
        state = resume["trainer"]
        self.iteration, self.version = int(state["iteration"]), int(state["version"])
        if self.train_config.resume_optimizer:
            self.optimizer.load_state_dict(resume["optimizer"])
            if resume["scaler"] and self.scaler.is_enabled():
                self.scaler.load_state_dict(resume["scaler"])
        ckpt.set_rng_state(state["rng"])  # rank 0's generators; the other ranks re-derive their own
        if self.rank > 0:
            _seed_everything(int(getattr(self.config, "seed", 0) or 0) + 1000 * self.rank + 1 + self.iteration)
        self.load_trainer_state(state.get("extra", {}))

    def _train_func(self) -> None:
        # No parameter: Ray Train passes its config to a loop function that takes one.
        self.setup_rank(local=self.in_process)
        self._connect()
        if self.rank == 0:
            self._publish_weights()  # rollout waits for the first weights
        tc = self.train_config
        for iteration in range(self.iteration + 1, tc.num_iterations + 1):
            self.run_iteration(iteration)
            if iteration < tc.num_iterations and self._stop_requested():
                # Ctrl-C / `mineonline stop`: leave a checkpoint of the last finished iteration.
                if iteration % tc.save_interval != 0:
                    self.save_checkpoint()
                self.last_metrics["trainer/stopped_early"] = 1.0
                break
        if not self.in_process:
            import ray.train

            ray.train.report(dict(self.last_metrics))

    def _stop_requested(self) -> bool:
        """Rank 0 asks the manager; every rank gets the same answer so that all stop together."""
        flag = 0.0
        if self.rank == 0 and hasattr(self.rollout_manager, "stop_requested"):
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
            self._workers = ray.get(manager.get_workers.remote())

    def run_iteration(self, iteration: int) -> dict[str, float]:
        tc = self.train_config
        self.iteration = iteration
        self.learning_rate, self.rho = self.learning_rate_at(iteration), self.rho_at(iteration)
        batch = self.fetch_fragments_and_estimate_advantages(tc.batches_per_iteration * tc.batch_size_per_gpu)
        start = time.perf_counter()
        metrics = self.train(batch)
        self.perf["perf/train_ms"] = 1e3 * (time.perf_counter() - start)
        start = time.perf_counter()
        if iteration > tc.vf_warmup:
            self.broadcast_model_to_rollout_workers(new_version=True)
        self.perf["perf/broadcast_ms"] = 1e3 * (time.perf_counter() - start)
        steps = batch["reward"].numel() * self.world_size * tc.epochs_per_iteration
        metrics = {**metrics, **self.perf, "trainer/iteration": iteration, "trainer/version": self.version,
                   "trainer/learning_rate": self.learning_rate, "trainer/rho": self.rho,
                   "trainer/samples_per_s": steps / max(self.perf["perf/train_ms"] / 1e3, 1e-9),
                   "trainer/staleness_mean": float(batch["staleness"].mean())}  # fmt: skip
        self.last_metrics = metrics
        if self.rank == 0:
            self._log(metrics, batch)
            if tc.record_video_interval and iteration % tc.record_video_interval == 0:
                self.rollout_manager.record_videos.remote()
        if iteration % tc.save_interval == 0 or iteration == tc.num_iterations:
            self.save_checkpoint()
        return metrics

    def fetch_fragments_and_estimate_advantages(self, num_chunks: int) -> dict:
        """This iteration's chunks, with GAE columns. The chunks of the next iteration are fetched
        in the background while this one trains; GAE is not, because it needs the updated model."""
        tc = self.train_config
        start = time.perf_counter()
        ahead, self._prefetch = self._prefetch, None
        batch = ahead[1].result() if ahead is not None and ahead[0] == num_chunks else self.fetch_chunks(num_chunks)
        fetched = time.perf_counter()
        if self.iteration < tc.num_iterations:
            # The next iteration trains at the version this one is about to publish: the buffer
            # judges staleness against that, so fetching early never loosens max_staleness.
            next_version = self.version + (1 if self.iteration > tc.vf_warmup else 0)
            self._prefetch = (num_chunks, self._fetch_in_background(num_chunks, next_version))
        batch = estimate_advantages(self.model, batch, version=self.version, context_length=tc.context_length,
                                    discount=tc.discount, gae_lambda=tc.gae_lambda)  # fmt: skip
        self.perf["perf/fetch_ms"] = 1e3 * (fetched - start)  # what the loop waited for, not the fetch itself
        self.perf["perf/gae_ms"] = 1e3 * (time.perf_counter() - fetched)
        return batch

    def fetch_chunks(self, num_chunks: int, for_version: int | None = None) -> dict:
        """Sample chunks fresh enough for ``for_version`` and read their payloads straight from the store."""
        start = time.perf_counter()
        chunks = ray.get(self._buffer.sample.remote(num_chunks, for_version))
        payloads = self._store.get_many([key for chunk in chunks for key in chunk["keys"]])
        # Payloads are in this process now: the buffer may drop used-up or evicted ones.
        ray.get(self._buffer.release.remote([chunk["chunk_id"] for chunk in chunks]))
        grouped, offset = [], 0
        for chunk in chunks:
            grouped.append(payloads[offset : offset + len(chunk["keys"])])
            offset += len(chunk["keys"])
        batch = assemble_chunks(grouped, device=self.device)
        self.perf["perf/fetch_chunks_ms"] = 1e3 * (time.perf_counter() - start)
        return batch

    def _fetch_in_background(self, num_chunks: int, for_version: int) -> Future:
        if self._fetcher is None:
            self._fetcher = _Fetcher()
        return self._fetcher.submit(self.fetch_chunks, num_chunks, for_version)

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """Bump the version (every rank) and publish the weights (rank 0, without waiting)."""
        if new_version:
            self.version += 1
        if self.rank == 0:
            self._publish_weights()

    def _publish_weights(self) -> None:
        weights = {k: v.detach().cpu().numpy() for k, v in unwrap(self.model).state_dict().items()}
        ref = self._put_weights(weights)
        # Straight to the workers this rank knows: one actor hop between the put and each worker's
        # get, not two. The manager records the weights (for restarted workers), tells the buffer
        # the version, and forwards them only when this rank has no worker handles.
        for worker in self._workers:
            worker.update_weights.remote([ref], self.version)
        self.rollout_manager.update_weights.remote([ref], self.version, forward=not self._workers)

    def _put_weights(self, weights: dict[str, np.ndarray]) -> Any:
        # Owned by this rank (Ray >= 2.56 has no ``_owner``): workers fetch it while training runs.
        return ray.put(weights)

    def _log(self, metrics: dict[str, float], batch: dict) -> None:
        if self.logger_hub is None:
            return
        columns = {"trainer/advantages": "advantage", "trainer/values": "value", "trainer/staleness": "staleness"}
        histograms = {key: batch[column].detach().float().cpu().numpy().ravel() for key, column in columns.items()}
        self.logger_hub.log_batch.remote(metrics, histograms)  # one actor task per iteration

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the checkpoint of the current iteration; every rank then runs ``on_checkpoint``."""
        path = None
        if self.rank == 0:
            path = ckpt.save_checkpoint(
                self.save_dir, iteration=self.iteration, model_state=unwrap(self.model).state_dict(),
                optimizer_state=self.optimizer.state_dict(), scaler_state=self.scaler.state_dict() if self.scaler.is_enabled() else {},
                trainer_state={"version": self.version, "rho": self.rho, "learning_rate": self.learning_rate, "extra": self.trainer_state()},
                config_yaml=self.whole_config, keep_interval=self.train_config.keep_interval,
            )  # fmt: skip
        self.on_checkpoint(path)
        return path


class _Fetcher:
    """One long-lived thread that runs the trainer's fetches ahead: one thread per iteration would
    churn the allocator's per-thread arenas. A daemon, because at a stop it may still be waiting in
    ``buffer.sample`` and must not hold the rank's process open."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="mineonline-prefetch", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the loop when it takes the batch
                future.set_exception(exc)


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
