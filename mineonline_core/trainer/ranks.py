"""Where ``TrainLoop``'s ranks run, and what a run returns.

``fit`` runs the loop on Ray Train ranks (``TorchTrainer``, restarted from the latest checkpoint when a
rank dies, see ``recovery.py``) or, for one rank, in the driver's own process: on its CPU, or on the
GPU share it leases from Ray (``trainer/device.py``; Ray Train takes over, saying why, when the
driver's process cannot use that GPU). Ray Train ranks send heartbeats; one silent past
``hang_timeout`` is named and killed, and so restarted like a dead rank (``services/heartbeat.py``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch

from mineonline_core.errors import ConfigError, RunFailedError, find_user_error, last_line
from mineonline_core.services.gpulease import lease_gpu
from mineonline_core.services.heartbeat import HeartbeatBoard, RankBeat, RankWatch
from mineonline_core.services.names import on_node
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer import recovery
from mineonline_core.trainer.device import rank_device

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)


class DriverSide:
    """``TrainLoop``'s ``fit``: Ray Train ranks or the driver's process."""

    def uses_ray_train(self) -> bool:
        """Ray Train for several ranks (or when asked); otherwise the driver's process, which may
        still hand a GPU rank to Ray Train when it cannot use the GPU (``fit``)."""
        if self.train_config.use_ray_train is not None:
            return self.train_config.use_ray_train
        return self.train_config.num_workers > 1

    def fit(self, *, device: torch.device | None = None) -> dict:
        """Run every iteration, on Ray Train ranks or in this process; return the final metrics.

        ``device``: run the single rank in this process on it, whatever the config says (a test's CPU
        device standing in for a GPU); None: the config decides, and a GPU rank leases its GPU."""
        self.preflight()
        for stale in ckpt.remove_stale_temporaries(self.save_dir):
            log.warning("removed %s, left by a checkpoint write whose process died", stale)
        self._fit_started, self.restarts = time.time(), 0
        if device is not None:
            return self._fit_in_process(device)
        if not self.uses_ray_train():
            device, lease = self._driver_device()
            if device is not None:
                try:
                    return self._fit_in_process(device)
                finally:
                    if lease is not None:
                        ray.kill(lease)
        self._built = None  # Ray Train's ranks build their own policy in their processes
        cpus, gpus = self.train_config.num_cpus_per_worker, self.train_config.num_gpus_per_worker  # per rank
        use_gpu = gpus > 0
        resources = {"CPU": cpus, **({"GPU": gpus} if use_gpu else {})}
        hang_timeout = float(getattr(self.config, "hang_timeout", 0.0) or 0.0)
        if hang_timeout:  # the ranks' heartbeats (pickled with self to each rank); pinned beside the driver
            self._heartbeats = ray.remote(HeartbeatBoard).options(num_cpus=0, scheduling_strategy=on_node()).remote()
        try:
            return self._fit_ray_train(resources, use_gpu, hang_timeout)
        finally:
            if hang_timeout:
                ray.kill(self._heartbeats)
                self._heartbeats = None

    def _fit_ray_train(self, resources: dict, use_gpu: bool, hang_timeout: float) -> dict:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer

        while True:  # one Ray Train run per attempt; see trainer/recovery.py for why not FailureConfig
            trainer = TorchTrainer(
                self._train_func,
                scaling_config=ScalingConfig(
                    num_workers=self.train_config.num_workers, use_gpu=use_gpu, resources_per_worker=resources
                ),
                torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
                run_config=RunConfig(storage_path=str(Path(self.run_dir) / "ray_train"), name=f"train-{self.restarts}"),
            )
            watch = None
            if hang_timeout:
                ray.get(self._heartbeats.clear.remote())
                watch = RankWatch(board=self._heartbeats, timeout=hang_timeout)
            try:
                return self._final_metrics(trainer.fit().metrics)
            except Exception as exc:
                user_error = find_user_error(exc)
                if user_error is not None:
                    raise user_error from exc
                # A rank killed as hung is the cause, whatever Ray Train says of its death.
                cause = watch.hung if watch is not None and watch.hung else last_line(exc, limit=200)
                if not recovery.is_rank_death(exc) or self.restarts >= self.train_config.max_trainer_restarts:
                    cap = f"train_config.max_trainer_restarts={self.train_config.max_trainer_restarts}"
                    limit = f" after {self.restarts} restart(s) ({cap})"
                    hung = f" {watch.hung}" if watch is not None and watch.hung else ""
                    raise RunFailedError(f"Training failed on a Ray Train worker{limit}:{hung} {exc}") from exc
                self.restarts += 1
                self.rank_hangs += int(bool(watch is not None and watch.hung))
                log.warning(
                    "a train worker died (%s); restarting training from the latest checkpoint (restart %d of %d)",
                    cause,
                    self.restarts,
                    self.train_config.max_trainer_restarts,
                )
            finally:
                if watch is not None:
                    watch.stop()

    def _start_beat(self) -> RankBeat | None:
        """On a Ray Train rank: its heartbeat thread, when the run watches hangs."""
        board = getattr(self, "_heartbeats", None)
        if self.in_process or board is None:
            return None
        return RankBeat(
            board=board,
            member=f"trainer rank {self.rank}",
            timeout=self.config.hang_timeout,
            detail=lambda: f"iteration {self.iteration}",
        )

    def _driver_device(self) -> tuple[torch.device | None, ActorHandle | None]:
        """The CPU, or the GPU this process leased (with its lease); None when Ray Train must run the
        GPU rank because this process cannot (logged), or a ConfigError when use_ray_train is false."""
        gpus = self.train_config.num_gpus_per_worker
        if gpus == 0:
            return torch.device("cpu"), None
        lease, gpu_ids, visible, count = None, [], os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()
        if count:
            lease, gpu_ids = lease_gpu(gpus)
        device, why = rank_device(gpu_ids=gpu_ids, visible_devices=visible, device_count=count)
        if device is not None:
            log.info("training in the driver's process on %s (%s)", device, why)
            return device, lease
        if lease is not None:
            ray.kill(lease)
        if self.train_config.use_ray_train is False:
            raise ConfigError(
                f"train_config.use_ray_train is false with num_gpus_per_worker {gpus:g}, which "
                f"trains in the driver's process on a GPU, but {why}. Fix: set use_ray_train to null (Ray Train "
                f"runs the rank when the driver cannot), make a GPU visible to the driver, or set "
                f"num_gpus_per_worker 0."
            )
        log.warning("the trainer's GPU rank runs on Ray Train, not in the driver's process: %s", why)
        return None, None

    def _fit_in_process(self, device: torch.device) -> dict:
        """The single-rank loop in this process on ``device``: what a Ray Train rank runs, without
        the seconds of start-up of its controller, placement group, worker group and process group."""
        threads = torch.get_num_threads()
        # As Ray Train gives a rank (OMP_NUM_THREADS): more threads than reserved CPUs spin
        # against the rollout workers for the same cores.
        torch.set_num_threads(max(1, int(self.train_config.num_cpus_per_worker)))
        self.in_process, self.device = True, device
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
