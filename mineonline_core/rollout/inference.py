"""Shared rollout inference: one ``InferenceServer`` actor runs the policy for the envs of every
rollout worker (``rollout_config.inference: shared``); the envs still step in the workers.

Four workers time-sharing one GPU each run small batches with the GPU idle between them; one
process that batches every worker's envs keeps it busy. On a machine without a GPU the server runs
on the CPU (the fallback the tests exercise).

* **The server keeps the recurrent states.** Each worker's envs have their slots here (``StateSlots``, the
  policy's and the KL reference's, on the server's device), keyed by worker id and refilled with initial
  states when a worker's new life (incarnation) first calls. A request (``stepping.StepRequest``, the same the
  in-process ``LocalPolicy`` runs) carries observations, ``first`` flags and env ids; a reply carries actions,
  log-probs and values, and states only for the rows that start a fragment. At VPT-2x one env's states weigh
  16 MiB: sending them with every step cost more than the forward.
* **A restarted server** (Ray restarts it) asks the manager for the latest weights again, and has lost every
  env's states: a request naming the server id of the old life is answered ``lost`` without running, and the
  collector restarts its envs' memory (``first`` on each env's next step, as the training forward will see it).
  The restarted server says so on the console and in ``run.log`` and counts it in ``rollout/inference_restarts``.
* **Coalescing.** Each call waits on its own actor thread; one batch thread runs, as soon as it is
  free, every request queued, concatenated into one forward, and splits the results. Workers
  served together return together, so a free server would otherwise run alternating halves of the
  workers for ever: while the queue lacks a worker it has served before, the batch thread waits for
  it up to ``rollout_config.inference_wait_ms`` (a condition wait that ends when the last one comes).
* **Weights** are double-buffered as in a worker's ``LocalPolicy``: ``update_weights`` returns at once, a loader
  thread fills a standby copy, the batch thread swaps it in between forwards, and every reply
  carries the version of the weights that chose its actions.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.errors import MineOnlineError
from mineonline_core.rollout.stepping import StateSlots, StepReply, StepRequest, policy_step, run_batch
from mineonline_core.rollout.threads import start_guarded
from mineonline_core.services.names import INFERENCE_SERVER
from mineonline_core.services.restarts import actor_restart
from mineonline_core.services.runlog import setup_actor_logging
from mineonline_core.services.weights import WeightReceiver
from mineonline_core.config.precision import PrecisionChoice

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.services.handles import RolloutManagerHandle

log = logging.getLogger(__name__)


__all__ = ["InferenceClient", "InferenceServer", "policy_step"]


class _Request:
    def __init__(self, request: StepRequest) -> None:
        self.worker_id, self.request = request.worker_id, request
        self.rows = len(request.first)
        self.done = threading.Event()
        self.reply: StepReply | None = None
        self.error: BaseException | None = None


class InferenceServer:
    """Threaded Ray actor; the manager starts it with ``max_concurrency`` above the worker count."""

    def __init__(
        self,
        *,
        policy_generator: Callable[[], Any],
        config: RolloutConfig,
        manager: RolloutManagerHandle | None = None,
        precision: PrecisionChoice = PrecisionChoice(),
    ) -> None:
        import uuid

        import torch

        setup_actor_logging()
        self.server_id = uuid.uuid4().hex  # a restarted server has another: requests naming the old one lost states
        restart = actor_restart(INFERENCE_SERVER)
        self.restarts = 0 if restart is None else restart[0]  # rollout/inference_restarts
        if restart is not None:
            log.warning(
                "the inference server %s died; Ray restarted it (restart %d, rollout/inference_restarts): it takes "
                "the latest weights again, and every env's recurrent memory restarts",
                restart[1],
                restart[0],
            )
        self._num_envs = config.worker_config.num_envs
        self._slots: dict[int, tuple[int, StateSlots]] = {}  # worker id -> (incarnation, its envs' states)
        self.device = torch.device("cuda" if config.num_gpus_per_worker > 0 else "cpu")
        # The same numerics as a local worker's forwards and the training forwards (config/precision.py).
        self.precision = precision.on(self.device.type)
        self.precision.apply_tf32()
        self.policy = policy_generator().to(self.device).eval().requires_grad_(False)
        self._standby = copy.deepcopy(self.policy)
        self._standby_version: int | None = None
        self._receiver = WeightReceiver(device=self.device)  # the fetch thread's alone: it reuses pinned buffers
        self.reference: Any = None
        self._pending_reference: Any = None  # loaded by the fetch thread, swapped in by the batch thread
        self.version: int | None = None
        self._wait_s = config.inference_wait_ms / 1e3
        self._manager = manager
        self._cv = threading.Condition()  # guards the queue, the weights hand-over and the counters
        self._queue: list[_Request] = []
        self._seen: set[int] = set()  # workers served so far: those the batch thread waits for
        self._latest: tuple[list, int] | None = None
        self._loaded = threading.Event()  # set once the first weights are in
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._forwards = self._multi_worker = 0
        self._window_rows = self._window_requests = self._window_forwards = 0
        self._window_ms = 0.0
        start_guarded(
            (self._batch_loop, self._fetch_loop),
            what="rollout inference server",
            prefix="inference",
            stop=self._stop,
            failed=self._failed,
        )

    # -- actor methods ------------------------------------------------------------------------

    def update_weights(self, weights: list, version: int) -> None:
        """Same call as ``RolloutWorker.update_weights``: ``weights[0]`` refers to the policy's
        state dict, ``weights[1]`` (with a KL reference) to the reference's. Returns at once."""
        self.health()
        with self._cv:
            if self._latest is None or version >= self._latest[1]:
                self._latest = (weights, int(version))
            self._cv.notify_all()

    def wait_weights(self, timeout: float) -> bool:
        """True once the first weights are loaded; False if they are not within ``timeout`` seconds."""
        self.health()
        return self._loaded.wait(timeout)

    def step(self, request: StepRequest) -> StepReply:
        """Run ``request`` in the next forward, with the rows of the other workers queued meanwhile; the reply
        carries the ``version`` of the weights that chose its actions."""
        self.health()
        while not self._loaded.wait(0.5):
            self.health()
        request = _Request(request)
        with self._cv:
            self._queue.append(request)
            self._cv.notify_all()
        while not request.done.wait(0.5):
            self.health()
        if request.error is not None:
            raise request.error
        return request.reply

    def metrics(self) -> dict[str, float]:
        """Cumulative forwards (and those holding rows of several workers), the requests queued now;
        rows, requests and milliseconds per forward averaged since the previous call."""
        self.health()
        with self._cv:
            n = max(self._window_forwards, 1)
            out = {
                "rollout/inference_forwards": float(self._forwards),
                "rollout/inference_restarts": float(self.restarts),
                "rollout/inference_multi_worker_forwards": float(self._multi_worker),
                "rollout/inference_queued": float(len(self._queue)),
            }
            if self._window_forwards:
                out.update(
                    {
                        "rollout/inference_batch_mean": self._window_rows / n,
                        "rollout/inference_requests_mean": self._window_requests / n,
                        "perf/inference_server_ms": self._window_ms / n,
                    }
                )
            self._window_rows = self._window_requests = self._window_forwards = 0
            self._window_ms = 0.0
        return out

    def health(self) -> None:
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        self._stop.set()

    # -- threads ------------------------------------------------------------------------------

    def _failed(self, error: MineOnlineError) -> None:
        self._error = self._error or error  # the first thread's: the others fail because of it

    def _fetch_loop(self) -> None:
        import ray

        if self._manager is not None:  # a restarted server takes the latest weights the manager has
            latest = ray.get(self._manager.latest_weights.remote())
            if latest is not None:
                self.update_weights(*latest)
        loaded, reference_loaded = None, None
        while not self._stop.is_set():
            with self._cv:
                while not self._stop.is_set() and (self._latest is None or self._latest is loaded):
                    self._cv.wait(timeout=0.5)
                loaded = self._latest
            if loaded is None or self._stop.is_set():  # stopped: the weights last loaded are not fetched again
                return
            refs, version = loaded
            try:
                state_dict = ray.get(refs[0])
            except ray.exceptions.ObjectLostError:  # its owner, a trainer rank, died: it republishes
                log.warning("inference server: the weights of version %d were lost; waiting for the next", version)
                continue
            if len(refs) > 1 and refs[1].hex() != reference_loaded:
                reference = copy.deepcopy(self.policy).requires_grad_(False)
                self._receiver.load(reference, ray.get(refs[1]), what="the inference server's KL reference")
                with self._cv:  # before the weights: no forward runs the new weights without it
                    self._pending_reference = reference
                reference_loaded = refs[1].hex()
            with self._cv:
                standby, self._standby_version = self._standby, None
            self._receiver.load(standby, state_dict, version=version, what="the inference server's policy")
            with self._cv:
                self._standby_version = version
                if self.version is None:
                    self._swap()
                    self._loaded.set()

    def _swap(self) -> None:
        """Under ``_cv``: bring in the loaded reference and weights (between forwards only)."""
        if self._pending_reference is not None:
            self.reference, self._pending_reference = self._pending_reference, None
        if self._standby_version is not None:
            self.policy, self._standby = self._standby, self.policy
            self.version, self._standby_version = self._standby_version, None

    def _batch_loop(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                if (
                    not self._cv.wait_for(lambda: self._queue or self._stop.is_set(), timeout=0.5)
                    or self._stop.is_set()
                ):
                    continue
                end = time.monotonic() + self._wait_s
                while not self._seen <= {r.worker_id for r in self._queue} and self._cv.wait(
                    max(end - time.monotonic(), 0.0)
                ):
                    pass  # woken by a new request; ``wait`` returns False once the window is over
                requests, self._queue = self._queue, []
                self._swap()
            self._run(requests)

    def _run(self, requests: list[_Request]) -> None:
        import torch

        t0 = time.perf_counter()
        live = []
        for r in requests:
            slots = self._slots_for(r.request)
            if slots is None:
                r.reply = StepReply(lost=True, server_id=self.server_id)
                r.done.set()
            else:
                live.append((slots, r))
        if not live:
            return
        requests = [r for _, r in live]
        try:
            with torch.no_grad():
                replies = self._forward([(slots, r.request) for slots, r in live])
        except Exception as exc:  # noqa: BLE001 - each worker raises it with the envs it concerns
            for r in requests:
                r.error = exc
                r.done.set()
            return
        workers = {r.worker_id for r in requests}
        with self._cv:
            self._seen |= workers
            self._forwards += 1
            self._multi_worker += len(workers) > 1
            self._window_forwards += 1
            self._window_rows += sum(r.rows for r in requests)
            self._window_requests += len(requests)
            self._window_ms += (time.perf_counter() - t0) * 1e3
        for r, reply in zip(requests, replies):
            r.reply = reply
            r.done.set()

    def _slots_for(self, request: StepRequest) -> StateSlots | None:
        """The slots of the request's worker (the batch thread's alone), fresh for a new life; None when they
        were lost: the request names an earlier server, or comes from a life of the worker that was replaced."""
        if request.server_id is not None and request.server_id != self.server_id:
            return None
        incarnation, slots = self._slots.get(request.worker_id, (-1, None))
        if request.incarnation < incarnation:
            return None
        if slots is None or request.incarnation > incarnation:
            slots = StateSlots(initial_state=self.policy.initial_state, num_envs=self._num_envs, device=self.device)
            self._slots[request.worker_id] = (request.incarnation, slots)
        return slots

    def _forward(self, parts: list[tuple[StateSlots, StepRequest]]) -> list[StepReply]:
        replies = run_batch(
            policy=self.policy, reference=self.reference, precision=self.precision, device=self.device, parts=parts
        )
        for reply in replies:
            reply.version, reply.server_id = self.version, self.server_id
        return replies


class InferenceClient:
    """A worker's side of the server: blocking calls from the collect thread."""

    def __init__(self, *, server: ActorHandle[InferenceServer], worker_id: int) -> None:
        self.server, self.worker_id = server, worker_id

    def wait_weights(self, timeout: float) -> bool:
        import ray

        return ray.get(self.server.wait_weights.remote(timeout))

    def step(self, request: StepRequest) -> StepReply:
        import ray

        request.worker_id = self.worker_id
        return ray.get(self.server.step.remote(request))
