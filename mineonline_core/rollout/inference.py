"""Shared rollout inference: one ``InferenceServer`` actor runs the policy for the envs of every
rollout worker (``rollout_config.inference: shared``); the envs still step in the workers.

Four workers time-sharing one GPU each run small batches with the GPU idle between them; one
process that batches every worker's envs keeps it busy. On a machine without a GPU the server runs
on the CPU (the fallback the tests exercise).

* **Requests carry the recurrent states.** The server keeps no per-env state: a worker's
  ``FragmentCollector`` holds its envs' states (and the KL reference's) exactly as with local
  inference, sends the rows it selected and writes back the states the server returns. So the
  ``state_in`` a fragment stores is the tensor the server ran, episode resets and bootstrap rows
  work unchanged, a restarted worker starts from initial states, and a restarted server (Ray
  restarts it) loses only its weights, which it asks the manager for again; the calls in flight
  are retried. The price: states cross the object store at every step.
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
from mineonline_core.contracts.tree import to_numpy, to_torch, tree_cat, tree_map
from mineonline_core.errors import RunFailedError
from mineonline_core.services.runlog import setup_actor_logging
from mineonline_core.config.precision import PrecisionChoice

if TYPE_CHECKING:
    from mineonline_core.services.handles import InferenceServerHandle, RolloutManagerHandle

log = logging.getLogger(__name__)


def policy_step(policy: Any, obs: Any, state: Any, first: Any) -> tuple[Any, Any, Any, Any]:
    """One batched rollout forward (call under ``torch.no_grad``): sampled action, its log-prob,
    the denormalised value and the state after the step. Local and shared inference both run this."""
    latents, state_out = policy(input=obs, state_in=state, context={"first": first})
    pi_logits, rows = latents["pi_logits"], first.shape[0]
    action = policy.pi_head.sample(pi_logits)
    logprob = policy.pi_head.logprob(action, pi_logits).reshape(rows)
    vpred = policy.value_head.denormalize(latents["vpred"]).reshape(rows)
    return action, logprob, vpred, state_out


class _Request:
    def __init__(self, worker_id: int, batch: dict) -> None:
        self.worker_id, self.batch = worker_id, batch
        self.rows = len(batch["first"])
        self.done = threading.Event()
        self.reply: dict | None = None
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
        import torch

        setup_actor_logging()
        self.device = torch.device("cuda" if config.num_gpus_per_worker > 0 else "cpu")
        # The same numerics as a local worker's forwards and the training forwards (config/precision.py).
        self.precision = precision.on(self.device.type)
        self.precision.apply_tf32()
        self.policy = policy_generator().to(self.device).eval().requires_grad_(False)
        self._standby = copy.deepcopy(self.policy)
        self._standby_version: int | None = None
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
        for fn in (self._batch_loop, self._fetch_loop):
            threading.Thread(target=self._guard, args=(fn,), name=f"inference-{fn.__name__}", daemon=True).start()

    # -- actor methods ------------------------------------------------------------------------

    def update_weights(self, weights: list, version: int) -> None:
        """Same call as ``RolloutWorker.update_weights``: ``weights[0]`` refers to the policy's
        state dict, ``weights[1]`` (with a KL reference) to the reference's. Returns at once."""
        self.health()
        with self._cv:
            if self._latest is None or version >= self._latest[1]:
                self._latest = (weights, int(version))
            self._cv.notify_all()

    def initial_state(self, batch_size: int) -> Any:
        """The policy's initial recurrent state for ``batch_size`` envs (numpy; None when stateless)."""
        return to_numpy(self.policy.initial_state(batch_size))

    def wait_weights(self, timeout: float, batch_size: int) -> tuple[bool, Any]:
        """``(True, the reference's initial state for ``batch_size`` envs, or None without a reference)``
        once the first weights are loaded; ``(False, None)`` if they are not within ``timeout`` seconds."""
        self.health()
        if not self._loaded.wait(timeout):
            return False, None
        with self._cv:
            reference = self._pending_reference or self.reference
        return True, None if reference is None else to_numpy(reference.initial_state(batch_size))

    def infer(self, worker_id: int, batch: dict) -> dict:
        """Run ``batch`` (numpy: ``obs`` (B,1,...), ``state`` (B,...), ``first`` (B,1), ``n``: the rows
        that choose actions, the rest being value-only rows; ``ref_state`` for the first ``n`` rows
        or None) in the next forward. Returns numpy ``action``, ``logprob``, ``vpred`` and
        ``state_out`` for every row, ``ref_state_out`` and the ``version`` of the weights used."""
        self.health()
        while not self._loaded.wait(0.5):
            self.health()
        request = _Request(worker_id, batch)
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

    def _guard(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - stored, logged, raised by every later call
            log.exception("inference server: thread %s failed", loop.__name__)
            self._error = (
                exc
                if isinstance(exc, RunFailedError)
                else RunFailedError(
                    f"the rollout inference server's {loop.__name__} thread failed: {type(exc).__name__}: {exc}"
                )
            )
            self._stop.set()

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
            if loaded is None:
                return
            refs, version = loaded
            try:
                state_dict = ray.get(refs[0])
            except ray.exceptions.ObjectLostError:  # its owner, a trainer rank, died: it republishes
                log.warning("inference server: the weights of version %d were lost; waiting for the next", version)
                continue
            if len(refs) > 1 and refs[1].hex() != reference_loaded:
                reference = copy.deepcopy(self.policy).requires_grad_(False)
                reference.load_state_dict(_tensors(ray.get(refs[1])))
                with self._cv:  # before the weights: no forward runs the new weights without it
                    self._pending_reference = reference
                reference_loaded = refs[1].hex()
            with self._cv:
                standby, self._standby_version = self._standby, None
            standby.load_state_dict(_tensors(state_dict))
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
        try:
            with torch.no_grad():
                replies = self._forward([r.batch for r in requests])
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

    def _forward(self, batches: list[dict]) -> list[dict]:
        dev = self.device
        obs = tree_cat([to_torch(b["obs"], dev) for b in batches])
        state = tree_cat([to_torch(b["state"], dev) for b in batches])
        first = tree_cat([to_torch(b["first"], dev) for b in batches])
        with self.precision.autocast():
            action, logprob, vpred, state_out = policy_step(self.policy, obs, state, first)
        action, logprob, vpred = to_numpy(action), logprob.float().cpu().numpy(), vpred.float().cpu().numpy()
        state_out = to_numpy(state_out)
        ref = [b for b in batches if b["ref_state"] is not None]
        ref_out = None
        if ref:
            if self.reference is None:
                raise RunFailedError(
                    "a rollout worker sent KL-reference states, but the inference server has no reference policy"
                )
            ref_obs = tree_cat([to_torch(tree_map(lambda x: x[: b["n"]], b["obs"]), dev) for b in ref])
            ref_first = tree_cat([to_torch(b["first"][: b["n"]], dev) for b in ref])
            with self.precision.autocast():
                _, ref_out = self.reference(
                    input=ref_obs,
                    state_in=tree_cat([to_torch(b["ref_state"], dev) for b in ref]),
                    context={"first": ref_first},
                )
            ref_out = to_numpy(ref_out)
        replies, row, ref_row = [], 0, 0
        for b in batches:
            own, ref_own = slice(row, row + len(b["first"])), slice(ref_row, ref_row + b["n"])
            reply = {
                "action": tree_map(lambda x: x[own], action),
                "logprob": logprob[own],
                "vpred": vpred[own],
                "state_out": tree_map(lambda x: x[own], state_out),
                "ref_state_out": None,
                "version": self.version,
            }
            if b["ref_state"] is not None:
                reply["ref_state_out"] = tree_map(lambda x: x[ref_own], ref_out)
                ref_row += b["n"]
            replies.append(reply)
            row += len(b["first"])
        return replies


def _tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store
        return {k: torch.as_tensor(v) for k, v in state_dict.items()}


class InferenceClient:
    """A worker's side of the server: blocking calls from the collect thread."""

    def __init__(self, *, server: InferenceServerHandle, worker_id: int) -> None:
        self.server, self.worker_id = server, worker_id

    def initial_state(self, batch_size: int) -> Any:
        import ray

        return ray.get(self.server.initial_state.remote(batch_size))

    def wait_weights(self, timeout: float, batch_size: int) -> tuple[bool, Any]:
        import ray

        return ray.get(self.server.wait_weights.remote(timeout, batch_size))

    def infer(self, batch: dict) -> dict:
        import ray

        return ray.get(self.server.infer.remote(self.worker_id, batch))
