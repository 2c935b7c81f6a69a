"""``FragmentCollector``: the synchronous, Ray-free core of a rollout worker.

It steps ``len(env_fns)`` env subprocesses asynchronously and runs one batched policy forward over
the first ``batch_size`` envs that have an observation, so a slow env never stalls the others: when
``batch_size`` is ``num_envs``, an env late past ten times the mean step time is left out of the
batch (a partial batch) until it answers or ``step_timeout`` rebuilds it (``_gather``).
Each env's steps are cut into fragments of ``fragment_length`` steps (columns: ``fragment.py``).

Episode ends, the three ways (DESIGN §5.2, §5.5):

* ``terminated``: a true terminal; nothing to bootstrap.
* ``truncated`` by the env (time limit) or by ``restart_interval``: the value of the final
  observation, under the env's recurrent state at that point, is computed as an extra value-only
  row of the next batched forward and stored in ``bootstrap``.
* the env raised, hung past ``step_timeout`` or its process died: the in-flight step is closed as
  truncated with ``bootstrap = vpred`` of that step (the last value we have), the episode is
  reported as truncated and the env is rebuilt after an exponential back-off. Other envs go on.
  When the step itself succeeded and ended the episode and only the automatic reset after it
  failed, the step is kept as it happened (its reward, ``terminated`` and final observation) and
  then the env is rebuilt.
* the env answered a NaN or infinite reward or observation: the same, except that the env is
  reset instead of rebuilt (``mineonline_core.services.finite``); the bad values never enter a fragment.

After any episode end the env's recurrent state is replaced by ``policy.initial_state(1)`` and the
next step carries ``first=True`` (the policy resets there too, so training reproduces rollout).

With a KL reference policy (``set_reference``), every batch also runs the reference over the same
observations with its own recurrent state, reset at the same episode ends; each fragment records
that state at its start as ``ref_state_in``, so training can run the reference over a chunk exactly
as it would have run through the whole episode (DESIGN §5.4).

With ``inference`` (an ``InferenceClient``, ``rollout_config.inference: shared``) the forward runs
in the shared inference server instead: the collector still owns every recurrent state, sends the
selected rows with the batch and writes back what the server returns, and records the version
the server reports for the weights that chose the actions (``mineonline_core.rollout.inference``).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import warnings
from collections import deque
from multiprocessing import connection
from typing import Any, Callable

import torch

from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.errors import RunFailedError, last_line
from mineonline_core.services.finite import env_answer_problem
from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.rollout.envproc import EnvFailure, EnvProcess, InlineEnv, default_context
from mineonline_core.rollout.fragbuild import FragmentBuilder, Timers, VideoRecorder
from mineonline_core.rollout.inference import policy_step
from mineonline_core.contracts.fragment import stream_name
from mineonline_core.contracts.tree import to_numpy, to_torch, tree_map, tree_stack
from mineonline_core.services.restarts import RestartBudget

log = logging.getLogger(__name__)

# A busy env holds a batch for at most LATE_FACTOR times the mean step time (never less than
# LATE_FLOOR_S: a fast env's jitter must not split every batch); then the ready envs go on without it.
LATE_FACTOR = 10.0
LATE_FLOOR_S = 0.2
# Starts of a never-started env that may fail with the same exception before the worker gives up.
STARTUP_ATTEMPTS = 3


class _Slot:
    """Everything the collector tracks for one env."""

    def __init__(self, env_id: int) -> None:
        self.env_id = env_id
        self.proc: EnvProcess | InlineEnv | None = None
        self.obs: Any = None  # the observation awaiting an action; None while busy or down
        self.first = True
        self.pending_t: int | None = None  # index in ``builder`` of the step in flight
        self.sent_at = 0.0
        self.deadline = 0.0
        self.started_at = 0.0
        self.restart_at: float | None = 0.0  # when down: the time to rebuild
        self.failures_in_row = 0
        self.started = False  # has this env ever answered its first reset?
        self.startup_error: str | None = None  # the exception that stopped its last start
        self.same_startup_errors = 0
        self.builds = 0
        self.builder: FragmentBuilder | None = None
        self.next_index = 0
        self.episode_id = 0
        self.task: str | None = None
        self.ep_return = self.ep_disc_return = 0.0
        self.ep_discount = 1.0
        self.ep_len = 0


class FragmentCollector:
    """Collects fragments from ``env_fns`` with ``policy``. Not thread-safe except ``set_weights``,
    ``episode_records``, ``videos`` and ``metrics``, which other threads may call.

    Weights are double-buffered: ``set_weights`` (another thread) copies them into a standby copy
    of the policy while this thread keeps stepping with the current one, and ``step`` swaps the two
    between batches. A broadcast therefore stalls rollout for a reference swap, not for a
    ``load_state_dict`` of the whole model, at the price of one more copy of the parameters."""

    def __init__(
        self,
        *,
        policy: torch.nn.Module | None,
        env_fns: list[Callable[[], Any]],
        config: RolloutConfig,
        discount: float = 0.99,
        worker_id: int = 0,
        incarnation: int = 0,
        seed: int | None = None,
        version: int = 0,
        startup_timeout: float | None = None,
        backoff_base: float = 0.1,
        backoff_max: float = 10.0,
        precision: PrecisionChoice = PrecisionChoice(),
        inference: Any = None,
    ) -> None:
        """``config`` is the run's ``rollout_config`` (its ``worker_config`` but ``num_envs``, which
        ``env_fns`` gives, plus ``fragment_length`` and ``restart_window``); ``discount`` only
        weighs the episodes' discounted returns in the statistics. ``precision`` (from
        ``train_config``) makes the policy and reference forwards compute as the training forwards do.
        With ``inference`` (an ``InferenceClient``) ``policy`` is None: the server holds it and gives
        the initial states."""
        wc = config.worker_config
        batch_size = wc.batch_size
        if batch_size > len(env_fns):
            raise ValueError(f"batch_size={batch_size} exceeds the number of envs ({len(env_fns)})")
        self._inference = inference
        device = "cuda" if config.num_gpus_per_worker > 0 and inference is None else "cpu"
        self.precision = precision.on(device)
        self.precision.apply_tf32()
        self.policy = None if inference is not None else policy.to(device).eval()
        self._standby = copy.deepcopy(self.policy)  # loaded by set_weights, swapped in by step
        self._standby_version: int | None = None  # set once the standby holds complete weights
        self.reference: torch.nn.Module | None = None
        self._pending_reference: torch.nn.Module | None = None  # loaded by set_reference, swapped in by step
        self.ref_state: Any = None
        self._load_lock = threading.Lock()  # one loader at a time
        self.env_processes = wc.env_processes
        self.env_fns = list(env_fns)
        self.fragment_length, self.batch_size, self.discount = config.fragment_length, batch_size, discount
        self.step_timeout, self.max_env_restarts = wc.step_timeout, wc.max_env_restarts
        self._rebuilds = RestartBudget(cap=wc.max_env_rebuilds, window=config.restart_window)
        self._last_failure = ""
        # Building a simulator (Minecraft) can take far longer than a step: its own, longer limit.
        self.startup_timeout = startup_timeout if startup_timeout is not None else max(wc.step_timeout, 120.0)
        self.worker_id, self.incarnation, self.device = worker_id, incarnation, torch.device(device)
        self.restart_interval, self.seed = wc.restart_interval, seed
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.version = version
        self._ctx = default_context()
        self._slots = [_Slot(i) for i in range(len(env_fns))]
        self._ready: deque[int] = deque()
        self._step_mean: float | None = None  # moving mean of the envs' step round trips, in seconds
        self._value_rows: list[tuple[FragmentBuilder, int, Any, Any]] = []
        self._fragments: deque[dict] = deque()
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self.timers = Timers()
        self.video = VideoRecorder()
        self.env_steps = self.env_restarts = self.env_failures = self.env_nonfinite = self.fragments_done = 0
        initial_state = inference.initial_state if inference is not None else policy.initial_state
        with torch.no_grad():
            self._init_row = to_torch(initial_state(1), self.device)
            self.state = to_torch(initial_state(len(env_fns)), self.device)
        for slot in self._slots:
            self._start_env(slot, time.monotonic())

    # -- public API ---------------------------------------------------------------------------

    def set_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights into the standby policy (on the caller's thread, while stepping goes on);
        the next ``step`` swaps them in (never within one)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store
            tensors = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        with self._load_lock:
            with self._lock:
                # Not swappable while half-loaded. The stepping thread never touches the standby
                # between swaps, so loading into it needs no lock of the stepping thread's.
                standby, self._standby_version = self._standby, None
            standby.load_state_dict(tensors)
            with self._lock:
                self._standby_version = int(version)

    def set_reference(self, state_dict: dict[str, Any]) -> None:
        """Load the KL reference policy's weights (on the caller's thread); the next ``step`` starts
        running it. A reference that replaces another keeps the recurrent states reached so far."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store
            tensors = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        with self._load_lock:
            reference = copy.deepcopy(self._standby).eval().requires_grad_(False)
            reference.load_state_dict(tensors)
            with self._lock:
                self._pending_reference = reference

    def start_shared_reference(self, initial_state: Any) -> None:
        """Shared inference with a KL reference (the server has it): keep its recurrent states from
        ``initial_state`` (every env's, from the server) on. Called before the first step."""
        self.ref_state = to_torch(initial_state, self.device)

    def step(self) -> int:
        """Wait for ready envs, run one batched forward, send the actions. Returns the batch size."""
        self._swap_weights()
        rows = self._gather()
        if not rows and not self._value_rows:
            return 0
        self._infer(rows)
        return len(rows)

    def warmup(self, timeout: float) -> None:
        """Wait until every env has been built and reset (failed ones are rebuilt meanwhile)."""
        end = time.monotonic() + timeout
        while not all(s.obs is not None for s in self._slots):
            if time.monotonic() >= end:
                down = [s for s in self._slots if s.obs is None]
                causes = "".join(f"\n  env {s.env_id}: last failure {s.startup_error}" for s in down if s.startup_error)
                raise TimeoutError(
                    f"worker {self.worker_id}: envs {[s.env_id for s in down]} not ready after {timeout:.0f}s{causes}"
                )
            self._poll(max_wait=0.5)

    def collect(self, num_fragments: int) -> list[dict]:
        """Step until ``num_fragments`` fragments are complete; return exactly that many (oldest first)."""
        while len(self._fragments) < num_fragments:
            self.step()
        return [self._fragments.popleft() for _ in range(num_fragments)]

    def pop_fragments(self) -> list[dict]:
        """Every fragment completed so far (oldest first)."""
        out = list(self._fragments)
        self._fragments.clear()
        return out

    def episode_records(self) -> list[dict]:
        """Drain finished episodes (see ``EpisodeStatistics.add_episodes`` for the record)."""
        with self._lock:
            out, self._records = self._records, []
        return out

    def record_video(self, env_id: int = 0) -> None:
        """Record env ``env_id``'s next whole episode; drained by ``videos()``."""
        self.video.arm(env_id)

    def videos(self) -> list[dict]:
        return self.video.drain()

    def metrics(self) -> dict[str, float]:
        """Counters (cumulative) and ``perf/*`` means since the previous call."""
        return {
            "rollout/env_steps": float(self.env_steps),
            "rollout/env_restarts": float(self.env_restarts),
            "rollout/env_failures": float(self.env_failures),
            "rollout/env_nonfinite": float(self.env_nonfinite),
            "rollout/fragments": float(self.fragments_done),
            "rollout/model_version": float(self.version),
            **self.timers.drain(),
        }

    def close(self) -> None:
        for slot in self._slots:
            if slot.proc is not None:
                slot.proc.close(timeout=2.0)
                slot.proc = None

    # -- env lifecycle ------------------------------------------------------------------------

    def _start_env(self, slot: _Slot, now: float) -> None:
        seed = None if self.seed is None else self.seed + 1000 * self.worker_id + slot.env_id + 7919 * slot.builds
        if slot.builds:
            self.env_restarts += 1
            if slot.failures_in_row and self._rebuilds.add():  # restart_interval recycling is not a failure
                self.close()
                raise RunFailedError(
                    f"Rollout worker {self.worker_id}: its envs were rebuilt {self._rebuilds.count()} times within "
                    f"{self._rebuilds.span():.0f}s (rollout_config.worker_config.max_env_rebuilds={self._rebuilds.cap} "
                    f"per rollout_config.restart_window={self._rebuilds.window:g}s). Last failure: {self._last_failure}\n"
                    f"Fix the env, or raise max_env_rebuilds if failures are expected."
                )
        slot.builds += 1
        env_fn = self.env_fns[slot.env_id]
        slot.proc = EnvProcess(env_fn, ctx=self._ctx) if self.env_processes else InlineEnv(env_fn)
        slot.proc.send_reset(seed)
        slot.started_at = slot.sent_at = now
        slot.deadline = now + self.startup_timeout
        slot.restart_at = None
        slot.obs, slot.pending_t = None, None

    def _on_failure(self, slot: _Slot, exc: EnvFailure) -> None:
        if not slot.started and exc.kind == "error":
            self._check_startup(slot, exc)
        if exc.kind == "fatal":
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: the env factory for env {slot.env_id} cannot be loaded in its "
                f"env process:\n{exc.detail}\nEnv factories are pickled into a fresh process: define "
                f"env_generator in an importable module (or a Python config file), not in a test or notebook cell "
                f"that the env process cannot import."
            )
        now = time.monotonic()
        log.warning("worker %d env %d failed (%s); rebuilding. %s", self.worker_id, slot.env_id, exc.kind, exc.detail)
        self._fail_step(slot, exc.detail)
        slot.proc.kill()
        slot.proc, slot.obs, slot.pending_t = None, None, None
        delay = min(self.backoff_base * 2 ** (slot.failures_in_row - 1), self.backoff_max)
        slot.restart_at = now + delay

    def _on_nonfinite(self, slot: _Slot, problem: str) -> None:
        """A NaN or infinity in the env's answer: the step failed, but the env process is sound, so
        it is reset rather than rebuilt. The bad values never reach a fragment."""
        self.env_nonfinite += 1
        log.warning(
            "worker %d env %d: %s; the step counts as failed, its episode is closed as truncated and the env is reset",
            self.worker_id,
            slot.env_id,
            problem,
        )
        self._fail_step(slot, problem)
        slot.obs, slot.pending_t = None, None
        self._send(slot, functools.partial(slot.proc.send_reset, None), self.startup_timeout)

    def _send(self, slot: _Slot, send: Callable[[], None], timeout: float) -> None:
        """Send one command to the env with its deadline armed; a broken pipe is a failed env."""
        slot.sent_at = time.monotonic()
        slot.deadline = slot.sent_at + timeout
        try:
            send()
        except EnvFailure as exc:
            self._on_failure(slot, exc)

    def _fail_step(self, slot: _Slot, detail: str) -> None:
        """Count a failure and close the step in flight (if any) as truncated."""
        self.env_failures += 1
        slot.failures_in_row += 1
        self._last_failure = f"env {slot.env_id}: {detail}"
        if slot.pending_t is not None:
            b, t = slot.builder, slot.pending_t
            slot.pending_t = None
            b.complete(t, reward=0.0, terminated=False, truncated=True)
            b.bootstrap[t] = b.vpred[t]  # the last value we have stands in for the lost future
            self._end_episode(slot, truncated=True, final_obs=b.obs_at(t))
            self._maybe_emit(slot, b)
        if slot.failures_in_row > self.max_env_restarts:
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: env {slot.env_id} failed {slot.failures_in_row} times in a "
                f"row (rollout_config.worker_config.max_env_restarts={self.max_env_restarts}). Last failure: "
                f"{detail}\nFix the env, or raise max_env_restarts if failures are expected."
            )

    def _check_startup(self, slot: _Slot, exc: EnvFailure) -> None:
        """An env that never started and raises the same exception ``STARTUP_ATTEMPTS`` times in a row
        will not start: stop with its own error now, not at the warm-up timeout minutes later."""

        error = last_line(exc.detail)
        slot.same_startup_errors = slot.same_startup_errors + 1 if error == slot.startup_error else 1
        slot.startup_error = error
        if slot.same_startup_errors >= STARTUP_ATTEMPTS:
            self.close()
            raise RunFailedError(
                f"Rollout worker {self.worker_id}: env {slot.env_id} raised {error} while being built or reset, "
                f"{STARTUP_ATTEMPTS} times in a row, and never started; every env of this worker would fail the "
                f"same way. Fix the env (`mineonline check CONFIG` builds, resets and steps it once).\n{exc.detail}"
            )

    # -- gathering ready envs -----------------------------------------------------------------

    def _gather(self) -> list[int]:
        """Indices of up to ``batch_size`` envs with an observation, waiting as little as needed.

        A busy env is waited for only while it is punctual (``_late_after``): once it is late, the
        envs that have an observation go on as a partial batch, and the late one joins a later batch
        when it answers (or is rebuilt at ``step_timeout``). So a frozen env never holds the others,
        even when ``batch_size`` is ``num_envs``."""
        t0 = time.perf_counter()
        while True:
            now = self._restart_due()
            late_after = self._late_after()
            busy = [s for s in self._slots if s.proc is not None and s.obs is None]
            punctual = [s.sent_at + late_after for s in busy if s.sent_at + late_after > now]
            want = min(self.batch_size, len(punctual) + len(self._ready))  # rebuilt or late envs are not waited for
            if want and len(self._ready) >= want:
                break
            if not busy and self._value_rows:
                break  # nothing to wait for, but bootstrap values are owed
            self._poll(max_wait=min([1.0, *(t - now for t in punctual)]) if self._ready else 1.0)
        self.timers.add("perf/env_wait_ms", (time.perf_counter() - t0) * 1e3)
        return [self._ready.popleft() for _ in range(want)]

    def _late_after(self) -> float:
        """Seconds after which a busy env no longer holds a batch: ``LATE_FACTOR`` times the mean step
        time (``step_timeout`` until a step was measured), at least ``LATE_FLOOR_S``."""
        if self._step_mean is None:
            return self.step_timeout
        return min(max(LATE_FACTOR * self._step_mean, LATE_FLOOR_S), self.step_timeout)

    def _restart_due(self) -> float:
        now = time.monotonic()
        for slot in self._slots:
            if slot.proc is None and slot.restart_at is not None and slot.restart_at <= now:
                self._start_env(slot, now)
        return now

    def _poll(self, max_wait: float) -> None:
        """Rebuild envs whose back-off is over, then wait until an env answers, a hang deadline or
        the next scheduled rebuild (at most ``max_wait``), and handle what happened."""
        now = self._restart_due()
        busy = [s for s in self._slots if s.proc is not None and s.obs is None]
        wake = [s.deadline for s in busy] + [s.restart_at for s in self._slots if s.restart_at is not None]
        timeout = min(max(0.0, min(wake, default=now + max_wait) - now), max_wait)
        if not busy:
            time.sleep(timeout)
            return
        if not self.env_processes:  # inline envs answered already, inside send_step
            for slot in busy:
                self._receive(slot)
            return
        by_conn = {id(s.proc.conn): s for s in busy}
        for conn in connection.wait([s.proc.conn for s in busy], timeout):
            self._receive(by_conn[id(conn)])
        now = time.monotonic()
        for slot in busy:
            if slot.proc is not None and slot.obs is None and slot.deadline <= now:
                self._on_failure(slot, EnvFailure("timeout", f"no answer within {now - slot.sent_at:.1f}s"))

    def _receive(self, slot: _Slot) -> None:
        try:
            obs, reward, terminated, truncated, info, final_obs = slot.proc.recv()
        except EnvFailure as exc:
            if exc.step is not None and slot.pending_t is not None:
                # Only the reset after an episode end failed: the step itself stands as it happened.
                reward, terminated, truncated, info, final_obs = exc.step
                self._complete_step(slot, reward, terminated, truncated and not terminated, info, final_obs, None)
            self._on_failure(slot, exc)
            return
        problem = env_answer_problem(reward, obs, final_obs)
        if problem is not None:
            self._on_nonfinite(slot, problem)
            return
        now = time.monotonic()
        if slot.pending_t is None:  # the answer to a fresh process's reset
            slot.started = True
            slot.task = (info.get("reset_info") or {}).get("task")
            slot.obs, slot.first = obs, True
            self._ready.append(slot.env_id)
            return
        slot.failures_in_row = 0
        took = now - slot.sent_at  # a step's round trip: what a punctual env takes (``_late_after``)
        self._step_mean = took if self._step_mean is None else 0.9 * self._step_mean + 0.1 * took
        recycle = self.restart_interval > 0 and now - slot.started_at >= self.restart_interval
        trunc = (truncated or recycle) and not terminated
        self._complete_step(slot, reward, terminated, trunc, info, final_obs, obs)
        if recycle:
            slot.proc.close(timeout=5.0)
            self._start_env(slot, now)
            return
        if terminated or trunc:
            slot.task = (info.get("reset_info") or {}).get("task", slot.task)
        slot.obs = obs
        self._ready.append(slot.env_id)

    def _complete_step(
        self, slot: _Slot, reward: float, terminated: bool, trunc: bool, info: dict, final_obs: Any, obs: Any
    ) -> None:
        """Write the env's answer to the step in flight; close the episode when it ended."""
        self.timers.add("perf/env_step_ms", (time.monotonic() - slot.sent_at) * 1e3)
        self.env_steps += 1
        b, t = slot.builder, slot.pending_t
        slot.pending_t = None
        self._add_reward(slot, reward)
        b.complete(t, reward=reward, terminated=terminated, truncated=trunc)
        if terminated or trunc:
            end_obs = final_obs if final_obs is not None else obs
            if trunc:  # bootstrap from the final observation with the state the env had reached
                row = tree_map(lambda s: s[slot.env_id : slot.env_id + 1].clone(), self.state)
                b.pending_bootstraps += 1
                self._value_rows.append((b, t, end_obs, row))
            self._end_episode(slot, truncated=trunc, final_obs=end_obs, info=info)
        elif t == self.fragment_length - 1:
            b.set_next_obs(obs)
        self._maybe_emit(slot, b)

    def _add_reward(self, slot: _Slot, reward: float) -> None:
        slot.ep_return += reward
        slot.ep_disc_return += slot.ep_discount * reward
        slot.ep_discount *= self.discount
        slot.ep_len += 1
        self.video.reward(slot.env_id, slot.ep_return)

    def _end_episode(self, slot: _Slot, *, truncated: bool, final_obs: Any, info: dict | None = None) -> None:
        b = slot.builder  # the step that ended the episode is its last recorded one
        if b is not None and b.n == self.fragment_length and b.next_obs is None:
            b.set_next_obs(final_obs)
        if slot.ep_len:
            record = {
                "return": slot.ep_return,
                "discounted_return": slot.ep_disc_return,
                "length": slot.ep_len,
                "task": slot.task,
                "achievements": (info or {}).get("achievements"),
                "truncated": truncated,
                "stream": self._stream(slot),
            }
            with self._lock:
                self._records.append(record)
        self.video.episode_end(slot.env_id, slot.ep_return)
        slot.ep_return = slot.ep_disc_return = 0.0
        slot.ep_discount, slot.ep_len = 1.0, 0
        slot.episode_id += 1
        slot.first = True
        if self._init_row is not None:
            tree_map(lambda full, init: full[slot.env_id : slot.env_id + 1].copy_(init), self.state, self._init_row)
            if self.ref_state is not None:
                tree_map(
                    lambda full, init: full[slot.env_id : slot.env_id + 1].copy_(init), self.ref_state, self._init_row
                )

    # -- inference ----------------------------------------------------------------------------

    def _batch_failure(self, what: str, rows: list[int], exc: Exception) -> str:
        slots = sorted((self._slots[i] for i in rows), key=lambda slot: slot.env_id)
        shapes = "; ".join(
            f"env {slot.env_id}: {tree_map(lambda x: tuple(getattr(x, 'shape', ())), slot.obs)}" for slot in slots
        )
        return (
            f"rollout worker {self.worker_id}: {what} failed on the observations of envs "
            f"{[slot.env_id for slot in slots]} ({type(exc).__name__}: {exc}). Observation shapes: {shapes}. "
            f"Check that the env's observations match the observation space the policy was built for."
        )

    @torch.no_grad()
    def _infer(self, rows: list[int]) -> None:
        t0 = time.perf_counter()
        n, values = len(rows), self._value_rows
        self._value_rows = []
        obs_list = [self._slots[i].obs for i in rows] + [v[2] for v in values]
        try:
            obs = to_torch(tree_map(lambda x: x[:, None], tree_stack(obs_list)), self.device)
        except Exception as exc:  # envs whose observations cannot be stacked: name them
            raise RunFailedError(self._batch_failure("stacking the observations", rows, exc)) from exc
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        state_sel = None
        if self.state is not None:
            state_sel = tree_map(lambda s: s.index_select(0, idx), self.state)
            if values:
                state_sel = tree_map(lambda s, *vs: torch.cat([s, *vs]), state_sel, *[v[3] for v in values])
        first = torch.tensor([[self._slots[i].first] for i in rows] + [[False]] * len(values), device=self.device)
        ref_sel = (
            tree_map(lambda s: s.index_select(0, idx), self.ref_state) if self.ref_state is not None and n else None
        )
        try:
            if self._inference is None:
                with self.precision.autocast():
                    action, logprob, vpred, state_out = policy_step(self.policy, obs, state_sel, first)
                    ref_out = None
                    if ref_sel is not None:
                        _, ref_out = self.reference(
                            input=tree_map(lambda x: x[:n], obs), state_in=ref_sel, context={"first": first[:n]}
                        )
                action_np, logprob_np, vpred_np = (
                    to_numpy(action),
                    logprob.float().cpu().numpy(),
                    vpred.float().cpu().numpy(),
                )
            else:
                reply = self._inference.infer(
                    {
                        "obs": to_numpy(obs),
                        "state": to_numpy(state_sel),
                        "first": to_numpy(first),
                        "n": n,
                        "ref_state": to_numpy(ref_sel),
                    }
                )
                action_np, logprob_np, vpred_np = reply["action"], reply["logprob"], reply["vpred"]
                state_out, ref_out = (
                    to_torch(reply["state_out"], self.device),
                    to_torch(reply["ref_state_out"], self.device),
                )
                self.version = int(reply["version"])  # the weights that chose these actions
        except Exception as exc:  # a wrong observation shape fails deep in the policy: name the envs
            raise RunFailedError(self._batch_failure("the policy's forward", rows, exc)) from exc
        if self.state is not None and n:
            tree_map(lambda full, new: full.index_copy_(0, idx, new[:n].to(full.dtype)), self.state, state_out)
        if ref_sel is not None:
            tree_map(lambda full, new: full.index_copy_(0, idx, new.to(full.dtype)), self.ref_state, ref_out)
        ref_np = to_numpy(ref_sel)
        state_np = to_numpy(state_sel) if state_sel is not None else None
        t1 = time.perf_counter()
        self.timers.add("perf/inference_ms", (t1 - t0) * 1e3)
        self.timers.add("perf/inference_batch", float(n))
        for j, (b, t, _, _) in enumerate(values):
            b.bootstrap[t] = vpred_np[n + j]
            b.pending_bootstraps -= 1
            self._maybe_emit(self._slots[b.env_id], b)
        for j, i in enumerate(rows):
            slot = self._slots[i]
            if slot.builder is None:
                slot.builder = FragmentBuilder(
                    length=self.fragment_length,
                    stream=self._stream(slot),
                    index=slot.next_index,
                    worker_id=self.worker_id,
                    env_id=i,
                )
                slot.next_index += 1
            act = tree_map(lambda a: a[j, 0], action_np)
            if slot.builder.n == 0:
                slot.builder.state_in = tree_map(lambda s: s[j : j + 1].copy(), state_np)
                if ref_np is not None:
                    slot.builder.ref_state_in = tree_map(lambda s: s[j : j + 1].copy(), ref_np)
            slot.pending_t = slot.builder.record(
                obs=slot.obs,
                action=act,
                logprob=logprob_np[j],
                vpred=vpred_np[j],
                first=slot.first,
                version=self.version,
                episode_id=slot.episode_id,
            )
            self.video.step(i, slot.obs, float(vpred_np[j]), slot.first)
            slot.obs, slot.first = None, False
            self._send(slot, functools.partial(slot.proc.send_step, act), self.step_timeout)
        self.timers.add("perf/record_ms", (time.perf_counter() - t1) * 1e3)

    def _maybe_emit(self, slot: _Slot, b: FragmentBuilder) -> None:
        if not b.complete_fragment():
            return
        t0 = time.perf_counter()
        self._fragments.append(b.build())
        self.fragments_done += 1
        if slot.builder is b:
            slot.builder = None
        self.timers.add("perf/fragment_ms", (time.perf_counter() - t0) * 1e3)

    def _swap_weights(self) -> None:
        with self._lock:
            reference, self._pending_reference = self._pending_reference, None
        if reference is not None:
            self.reference = reference
            if self.ref_state is None:
                with torch.no_grad():
                    self.ref_state = to_torch(reference.initial_state(len(self._slots)), self.device)
        with self._lock:
            version, self._standby_version = self._standby_version, None
            if version is None:
                return
            self.policy, self._standby = self._standby, self.policy
        self.version = version

    def _stream(self, slot: _Slot) -> str:
        return stream_name(self.worker_id, self.incarnation, slot.env_id)
