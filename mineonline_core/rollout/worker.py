"""``RolloutWorker``: a Ray actor around a ``FragmentCollector``, with four background threads.

* **collect**: registers with the manager (which numbers this life of the worker and hands it the
  latest weights), builds the envs, waits for the first weights, then steps forever. Finished
  fragments go into a queue of ``to_send_queue_size``; a full queue blocks collection, which is
  the back-pressure when the store or buffer falls behind.
* **send**: writes fragments to the store, then announces them with ``buffer.add_fragments``
  (payload first, so the buffer never indexes a key that is not there yet); fragments that queued
  up meanwhile share one store write and one buffer call.
* **fetch**: ``update_weights`` returns at once; this thread resolves the newest weights ref and
  loads it into the collector's standby policy while the collect thread keeps stepping; the
  collect thread swaps the two between batches.
* **report**: every ``report_interval`` seconds sends env steps to the logging actor, finished
  episodes to the statistics actor, and encodes recorded videos.

With ``rollout_config.inference: shared`` the worker gets the run's ``InferenceServer`` instead of
weights: there is no **fetch** thread, the collector sends its batches to the server (which keeps the envs'
recurrent states, keyed by worker id and incarnation), and collection starts once the server has its first weights.

A thread that fails stores its exception; every later actor call re-raises it (``health``), so the
manager, and through it the driver, sees the cause instead of a silent stall.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable


from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.errors import MineOnlineError
from mineonline_core.rollout.fragbuild import Timers
from mineonline_core.rollout.threads import start_guarded
from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.services.runlog import setup_actor_logging

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.rollout.inference import InferenceServer
    from mineonline_core.rollout.stats import EpisodeStatistics
    from mineonline_core.services.handles import RolloutManagerHandle, StoreAccess
    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)


class SendQueue:
    """Finished fragments between the collect and send threads. ``put_all`` blocks while
    ``maxsize`` or more are waiting, then admits the fragments of one step together (so the bound
    is soft by up to ``num_envs - 1``); ``take_all`` empties the queue, so the sender writes what
    piled up in one call instead of one call per fragment."""

    def __init__(self, *, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: list[dict] = []
        self._cv = threading.Condition()

    def put_all(self, items: list[dict], stop: threading.Event) -> None:
        with self._cv:
            while len(self._items) >= self.maxsize and not stop.is_set():
                self._cv.wait(timeout=0.5)
            self._items.extend(items)
            self._cv.notify_all()

    def take_all(self, *, timeout: float) -> list[dict]:
        with self._cv:
            if not self._items:
                self._cv.wait(timeout=timeout)
            items, self._items = self._items, []
            self._cv.notify_all()
        return items

    def qsize(self) -> int:
        return len(self._items)

    def full(self) -> bool:
        return len(self._items) >= self.maxsize


class RolloutWorker:
    """Threaded Ray actor (the manager applies ``ray.remote`` with ``max_concurrency`` >= 4)."""

    def __init__(
        self,
        *,
        worker_id: int,
        config: RolloutConfig,
        policy_generator: Callable[[], Any],
        env_generator: Callable[[], Any],
        store_client: StoreAccess,
        buffer: ActorHandle[ReplayBuffer],
        stats: ActorHandle[EpisodeStatistics] | None = None,
        logger_hub: ActorHandle[LoggerHub] | None = None,
        manager: RolloutManagerHandle | None = None,
        discount: float = 0.99,
        seed: int | None = None,
        report_interval: float = 0.5,  # the resolution of the env-step axis every metric is logged on
        incarnation: int = 0,
        precision: PrecisionChoice = PrecisionChoice(),
        inference_server: ActorHandle[InferenceServer] | None = None,
    ) -> None:
        """``config`` is the run's ``rollout_config``; ``discount`` (``train_config.discount``) weighs
        the episodes' discounted returns in the statistics; ``precision`` (``train_config``'s) is the
        numerics of inference, those of the training forwards (``config/precision.py``);
        ``inference_server`` is the run's ``InferenceServer`` when ``config.inference`` is ``shared``."""
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        self.worker_id, self.config = worker_id, config
        self._policy_generator, self._env_generator = policy_generator, env_generator
        self._discount, self._seed, self._precision = discount, seed, precision
        self._store, self._buffer, self._stats, self._hub, self._manager = (
            store_client,
            buffer,
            stats,
            logger_hub,
            manager,
        )
        self._report_interval = report_interval
        self.incarnation = incarnation
        self._server = inference_server
        self.collector = None
        self._queue = SendQueue(maxsize=config.to_send_queue_size)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._has_weights = threading.Event()
        self._built = threading.Event()
        self._weights_cv = threading.Condition()
        self._latest_weights: tuple[list, int] | None = None
        self._error: BaseException | None = None
        self._sent = 0
        self._timers = Timers()  # the send thread's perf/* (the collector keeps its own)
        self._reported_steps = 0
        self._last_add: Any = None  # the ref of the latest add_env_steps call
        self._steps_lock = threading.Lock()
        self._threads = start_guarded(
            (self._collect_loop, self._send_loop, self._report_loop)
            + ((self._fetch_loop,) if inference_server is None else ()),
            what=f"rollout worker {self.worker_id}",
            prefix=f"rollout-{self.worker_id}",
            stop=self._stop,
            failed=self._failed,
        )

    # -- actor methods ------------------------------------------------------------------------

    def update_weights(self, weights: list, version: int) -> None:
        """``weights[0]`` refers to a CPU state dict of numpy arrays, ``weights[1]`` (when the
        trainer has a KL reference policy) to the reference's. Returns at once."""
        self.health()
        with self._weights_cv:
            if self._latest_weights is None or version >= self._latest_weights[1]:
                self._latest_weights = (weights, int(version))
            self._weights_cv.notify_all()

    def record_video(self) -> None:
        """Record env 0's next whole episode and send it to the logging actor."""
        self.health()
        if self.collector is not None:
            self.collector.record_video(0)

    def health(self) -> None:
        """Raise the exception a background thread died of, if any."""
        if self._error is not None:
            raise self._error

    def is_ready(self) -> bool:
        """True once every env is built and reset; raises when the worker failed."""
        self.health()
        return self._ready.is_set()

    def report(self) -> dict[str, float]:
        """Counters and ``perf/*`` means since the previous call (the manager aggregates them)."""
        self.health()
        if self.collector is None:
            return {}
        return {
            **self.collector.metrics(),
            **self._timers.drain(),
            "rollout/fragments_sent": float(self._sent),
            "rollout/send_queue": float(self._queue.qsize()),
        }

    def status(self) -> dict[str, Any]:
        c = self.collector
        return {
            "worker_id": self.worker_id,
            "incarnation": self.incarnation,
            "ready": self._ready.is_set(),
            "version": None if c is None else c.version,
            "env_steps": 0 if c is None else c.env_steps,
            "fragments_sent": self._sent,
            "error": None if self._error is None else repr(self._error),
        }

    def shutdown(self) -> None:
        """Stop the threads and close the envs (their processes are ended by pid)."""
        import ray

        self._stop.set()
        with self._weights_cv:
            self._weights_cv.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=10.0)
        if self.collector is not None:
            try:
                self._report_once()  # the tail: last env steps and finished episodes
                if self._last_add is not None:
                    # Waited for (the hub runs one caller's calls in order): once shutdown returns, the
                    # manager reads the run's final count from the hub.
                    ray.get(self._last_add, timeout=30)
            except Exception:  # noqa: BLE001 - the logging side may already be gone at shutdown
                log.debug("final report failed", exc_info=True)
            self.collector.close()

    # -- threads ------------------------------------------------------------------------------

    def _failed(self, error: MineOnlineError) -> None:
        self._error = self._error or error  # the first thread's: the others fail because of it

    def _collect_loop(self) -> None:
        import ray

        from mineonline_core.rollout.envproc import start_server

        if self.config.worker_config.env_processes:
            start_server()  # before torch's import (the collector's) and the policy's build
        from mineonline_core.rollout.collector import FragmentCollector

        if self._manager is not None:
            # The manager numbers each life of this worker (stream names stay unique across
            # restarts) and returns the latest weights, so a restarted worker rejoins at once.
            # pid and node: what the manager names when this life stops answering (services/heartbeat.py).
            where = {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}
            self.incarnation, latest = ray.get(self._manager.register_worker.remote(self.worker_id, **where))
            if latest is not None and self._server is None:
                self.update_weights(*latest)
        client = None
        if self._server is not None:
            from mineonline_core.rollout.inference import InferenceClient

            client = InferenceClient(server=self._server, worker_id=self.worker_id)
        num_envs = self.config.worker_config.num_envs
        self.collector = FragmentCollector(
            policy=self._policy_generator() if client is None else None,
            env_fns=[self._env_generator] * num_envs,
            config=self.config,
            discount=self._discount,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            seed=self._seed,
            precision=self._precision,
            inference=client,
        )
        self._built.set()
        self.collector.warmup(timeout=self.collector.pool.startup_timeout * 2)
        self._ready.set()
        if client is not None:  # the server has the weights: wait for its first
            while not client.wait_weights(0.5):
                if self._stop.is_set():
                    return
            self._has_weights.set()
        while not self._has_weights.wait(timeout=0.5):
            if self._stop.is_set():
                return
        while not self._stop.is_set():
            self.collector.step()
            frags = self.collector.pop_fragments()
            if frags:
                self._queue.put_all(frags, self._stop)  # blocks while the sender is behind

    def _send_loop(self) -> None:
        import ray

        in_flight: list = []
        while not self._stop.is_set():
            # Everything queued goes in one store write and one buffer call: with cheap envs,
            # per-call costs (not bytes) are what keep the sender behind.
            frags = self._queue.take_all(timeout=0.5)
            if not frags:
                continue
            t0 = time.perf_counter()
            metas = [F.fragment_meta(frag) for frag in frags]
            self._store.put_many([(meta["key"], frag) for meta, frag in zip(metas, frags)])
            t1 = time.perf_counter()
            # The steps behind these fragments reach the env-step axis before the trainer can train on
            # them: a fast trainer would otherwise log several iterations between two reports.
            self._report_env_steps()
            in_flight.append(self._buffer.add_fragments.remote(metas))
            self._sent += len(frags)
            if len(in_flight) > 8:  # bound the calls in flight and surface a dead buffer
                done, in_flight = ray.wait(in_flight, num_returns=len(in_flight) - 8)
                ray.get(done)
            self._timers.add("perf/store_put_ms", (t1 - t0) * 1e3 / len(frags))
            self._timers.add("perf/buffer_add_ms", (time.perf_counter() - t1) * 1e3 / len(frags))
            self._timers.add("perf/send_batch", float(len(frags)))

    def _fetch_loop(self) -> None:
        import ray

        loaded, reference_loaded = None, None  # the (refs, version) last taken; the reference's ref
        while not self._stop.is_set():
            with self._weights_cv:
                while not self._stop.is_set() and (self._latest_weights is None or self._latest_weights is loaded):
                    self._weights_cv.wait(timeout=0.5)
                if self._stop.is_set():
                    return
                loaded = self._latest_weights
                refs, version = loaded
            try:
                state_dict = ray.get(refs[0])
            except ray.exceptions.ObjectLostError as exc:  # its owner, a trainer rank, died: it republishes
                log.warning(
                    "rollout worker %d: the weights of version %d were lost with the trainer rank that "
                    "published them (%s); waiting for the next broadcast",
                    self.worker_id,
                    version,
                    type(exc).__name__,
                )
                continue
            while not self._built.wait(timeout=0.5):  # the collect thread is still building the policy
                if self._stop.is_set():
                    return
            if len(refs) > 1 and refs[1].hex() != reference_loaded:
                self.collector.set_reference(ray.get(refs[1]))  # before the weights: no fragment lacks it
                reference_loaded = refs[1].hex()
            self.collector.set_weights(state_dict, version)
            self._has_weights.set()

    def _report_loop(self) -> None:
        while not self._stop.wait(self._report_interval):
            self._report_once()

    def _report_env_steps(self) -> None:
        c = self.collector
        with self._steps_lock:  # the report and send threads both report
            steps = c.env_steps if c is not None else 0
            if self._hub is not None and steps > self._reported_steps:
                self._last_add = self._hub.add_env_steps.remote(steps - self._reported_steps)
                self._reported_steps = steps

    def _report_once(self) -> None:
        c = self.collector
        if c is None:
            return
        self._report_env_steps()
        records = c.episode_records()
        if records and self._stats is not None:
            self._stats.add_episodes.remote(records)
        for video in c.videos():
            try:
                self._send_video(video)
            except Exception:  # noqa: BLE001 - a video is not worth failing the rollout for
                log.warning("rollout worker %d: could not encode a video", self.worker_id, exc_info=True)

    def _send_video(self, video: dict) -> None:
        if self._hub is None:
            return
        from mineonline_core.services.video import encode_episode_video

        wc = self.config.worker_config
        mp4 = encode_episode_video(
            video["frames"],
            fps=wc.video_fps,
            returns=video["returns"],
            values=video["values"],
            upscale=wc.video_upscale,
        )
        self._hub.log_video.remote("rollout/video", mp4)
