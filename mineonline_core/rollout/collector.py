"""``FragmentCollector``: the synchronous, Ray-free core of a rollout worker.

It builds trajectories and batches inference over the envs of an ``EnvPool`` (``envpool.py``, which starts,
supervises and rebuilds the env processes): it asks the pool for the envs that have an observation, runs one
batched policy forward over the first ``batch_size`` of them through one interface (``stepping.Inference``:
``LocalPolicy`` in this process, or the shared server's ``InferenceClient``), hands the actions back and turns what
the envs answer into fragments of ``fragment_length`` steps (columns: ``fragment.py``; one builder per env,
``fragbuild.py``). The pool never waits on a late env, so a batch may be partial. The recurrent states stay where
inference runs; the collector asks for an env's states only at its fragment's first step (``STATE_IN``).

Episode ends, the three ways (termination and truncation kept apart; a failed env's episode is truncated):

* ``terminated``: a true terminal; nothing to bootstrap.
* ``truncated`` by the env (time limit) or by ``restart_interval``: the value of the final
  observation, under the env's recurrent state at that point, is computed as an extra value-only
  row of the next batched forward (from the state the env reached, kept where inference runs) and stored in
  ``bootstrap``.
* the env raised, hung past ``step_timeout``, its process died or it answered a NaN or infinite reward or
  observation (the pool's ``lost`` answer): the in-flight step is closed as truncated with ``bootstrap = vpred``
  of that step (the last value we have) and the episode is reported as truncated; the pool rebuilds or resets
  the env. When the step itself succeeded and ended the episode and only the automatic reset after it
  failed, the step is kept as it happened (its reward, ``terminated`` and final observation).

After any episode end the next step carries ``first=True``: inference runs it from ``policy.initial_state(1)``
(the policy resets there too, so training reproduces rollout).

With a KL reference policy (``set_reference``), every batch also runs the reference over the same
observations with its own recurrent state, reset at the same episode ends; each fragment records
that state at its start as ``ref_state_in``, so training can run the reference over a chunk exactly
as it would have run through the whole episode, and its logits at every step as ``ref_logits``,
so that training need not run it again.

Each step records the version the reply names for the weights that chose its actions. When a restarted
shared server answers that it lost this worker's states, every env's memory restarts: its next step carries
``first`` (mid-episode; the env goes on, and GAE does not read ``first``), and the bootstrap values owed are
the truncated steps' own values, as for a lost env.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import torch

from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.contracts.fragment import stream_name
from mineonline_core.contracts.tree import tree_map, tree_stack
from mineonline_core.errors import RunFailedError
from mineonline_core.rollout.envpool import Answer, EnvPool
from mineonline_core.rollout.fragbuild import FragmentBuilder, Timers, VideoRecorder
from mineonline_core.rollout.localpolicy import LocalPolicy
from mineonline_core.rollout.stepping import Inference, StepRequest

log = logging.getLogger(__name__)


class _Track:
    """Everything the collector tracks of one env's trajectory."""

    def __init__(self, env_id: int) -> None:
        self.env_id = env_id
        self.first = True
        self.pending_t: int | None = None  # index in ``builder`` of the step in flight
        self.builder: FragmentBuilder | None = None
        self.next_index = 0
        self.episode_id = 0
        self.task: str | None = None
        self.ep_return = self.ep_disc_return = 0.0
        self.ep_discount = 1.0
        self.ep_len = 0


class FragmentCollector:
    """Collects fragments from ``env_fns`` with ``policy``. Not thread-safe except ``set_weights``,
    ``set_reference``, ``episode_records``, ``videos`` and ``metrics``, which other threads may call.
    New weights load off the stepping thread and ``step`` swaps them in between batches (``LocalPolicy``)."""

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
        inference: Inference | None = None,
    ) -> None:
        """``config`` is the run's ``rollout_config`` (its ``worker_config`` but ``num_envs``, which
        ``env_fns`` gives, plus ``fragment_length`` and ``restart_window``); ``discount`` only
        weighs the episodes' discounted returns in the statistics. ``precision`` (from
        ``train_config``) makes the policy and reference forwards compute as the training forwards do.
        With ``inference`` (an ``InferenceClient``) ``policy`` is None: the server holds it."""
        wc = config.worker_config
        batch_size = wc.batch_size
        if batch_size > len(env_fns):
            raise ValueError(f"batch_size={batch_size} exceeds the number of envs ({len(env_fns)})")
        device = "cuda" if config.num_gpus_per_worker > 0 and inference is None else "cpu"
        self.precision = precision.on(device)
        self.precision.apply_tf32()
        self.device = torch.device(device)
        self.local = (
            None
            if inference is not None
            else LocalPolicy(
                policy=policy, device=self.device, precision=self.precision, num_envs=len(env_fns), version=version
            )
        )
        self.inference: Inference = self.local if inference is None else inference
        self._server_id: str | None = None  # the shared server holding our envs' states (StepReply.server_id)
        self.memory_losses = 0
        self.fragment_length, self.batch_size, self.discount = config.fragment_length, batch_size, discount
        self.worker_id, self.incarnation = worker_id, incarnation
        self.version = version
        self._slots = [_Track(i) for i in range(len(env_fns))]
        self._value_rows: list[tuple[FragmentBuilder, int, Any]] = []  # bootstrap values owed: builder, t, obs
        self._fragments: deque[dict] = deque()
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self.timers = Timers()
        self.video = VideoRecorder()
        self.env_steps = self.fragments_done = 0
        self.pool = EnvPool(
            env_fns=env_fns,
            config=config,
            worker_id=worker_id,
            seed=seed,
            startup_timeout=startup_timeout,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
        )

    # -- public API ---------------------------------------------------------------------------

    def set_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights (on the caller's thread, while stepping goes on); the next ``step`` swaps them in."""
        self.local.set_weights(state_dict, version)

    def set_reference(self, state_dict: dict[str, Any]) -> None:
        """Load the KL reference policy's weights (on the caller's thread); the next ``step`` starts
        running it. A reference that replaces another keeps the recurrent states reached so far."""
        self.local.set_reference(state_dict)

    def step(self) -> int:
        """Wait for ready envs, run one batched forward, send the actions. Returns the batch size."""
        ready = self._gather()
        if not ready and not self._value_rows:
            return 0
        self._infer(ready)
        return len(ready)

    def warmup(self, timeout: float) -> None:
        """Wait until every env has been built and reset (failed ones are rebuilt meanwhile)."""
        self._on_answers(self.pool.warmup(timeout))

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
        """Counters (cumulative) and ``perf/*`` means since the previous call. Env steps are not among
        them: the run counts them once, in the logging actor (the worker adds ``env_steps`` to it)."""
        return {
            **self.pool.metrics(),
            "rollout/fragments": float(self.fragments_done),
            "rollout/model_version": float(self.version),
            "rollout/inference_memory_losses": float(self.memory_losses),
            **self.timers.drain(),
        }

    def close(self) -> None:
        self.pool.close()

    # -- what the envs said ------------------------------------------------------------------

    def _gather(self) -> list[tuple[int, Any]]:
        """Up to ``batch_size`` ``(env_id, observation)`` pairs from the pool, waiting as little as needed:
        the pool hands out a partial batch rather than wait for a late env (``EnvPool.take``)."""
        t0 = time.perf_counter()
        while True:
            ready = self.pool.take(self.batch_size)
            if ready is not None:
                break
            if self._value_rows and self.pool.idle():
                ready = []
                break  # nothing to wait for, but bootstrap values are owed
            self._on_answers(self.pool.wait())
        self.timers.add("perf/env_wait_ms", (time.perf_counter() - t0) * 1e3)
        return ready

    def _on_answers(self, answers: list[Answer]) -> None:
        for answer in answers:
            slot = self._slots[answer.env_id]
            if answer.kind == "reset":
                slot.task = (answer.info.get("reset_info") or {}).get("task")
                slot.first = True
            elif answer.kind == "step":
                a = answer
                self._complete_step(slot, a.reward, a.terminated, a.truncated, a.info, a.final_obs, a.obs)
                if a.terminated or a.truncated:
                    slot.task = (a.info.get("reset_info") or {}).get("task", slot.task)
            else:
                self._lose_step(slot)

    def _lose_step(self, slot: _Track) -> None:
        """The env failed: close the step in flight (if any) as truncated."""
        if slot.pending_t is not None:
            b, t = slot.builder, slot.pending_t
            slot.pending_t = None
            b.complete(t, reward=0.0, terminated=False, truncated=True)
            b.bootstrap[t] = b.vpred[t]  # the last value we have stands in for the lost future
            self._end_episode(slot, truncated=True, final_obs=b.obs_at(t))
            self._maybe_emit(slot, b)

    def _complete_step(
        self, slot: _Track, reward: float, terminated: bool, trunc: bool, info: dict, final_obs: Any, obs: Any
    ) -> None:
        """Write the env's answer to the step in flight; close the episode when it ended."""
        self.env_steps += 1
        b, t = slot.builder, slot.pending_t
        slot.pending_t = None
        self._add_reward(slot, reward)
        b.complete(t, reward=reward, terminated=terminated, truncated=trunc)
        if terminated or trunc:
            end_obs = final_obs if final_obs is not None else obs
            if trunc:  # bootstrap from the final observation with the state the env reached (kept by inference)
                b.pending_bootstraps += 1
                self._value_rows.append((b, t, end_obs))
            self._end_episode(slot, truncated=trunc, final_obs=end_obs, info=info)
        elif t == self.fragment_length - 1:
            b.set_next_obs(obs)
        self._maybe_emit(slot, b)

    def _add_reward(self, slot: _Track, reward: float) -> None:
        slot.ep_return += reward
        slot.ep_disc_return += slot.ep_discount * reward
        slot.ep_discount *= self.discount
        slot.ep_len += 1
        self.video.reward(slot.env_id, slot.ep_return)

    def _end_episode(self, slot: _Track, *, truncated: bool, final_obs: Any, info: dict | None = None) -> None:
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
        slot.first = True  # inference runs the next step from the initial states

    # -- inference ----------------------------------------------------------------------------

    def _batch_failure(self, what: str, ready: list[tuple[int, Any]], exc: Exception) -> str:
        ready = sorted(ready, key=lambda pair: pair[0])
        shapes = "; ".join(f"env {i}: {tree_map(lambda x: tuple(getattr(x, 'shape', ())), obs)}" for i, obs in ready)
        return (
            f"rollout worker {self.worker_id}: {what} failed on the observations of envs "
            f"{[i for i, _ in ready]} ({type(exc).__name__}: {exc}). Observation shapes: {shapes}. "
            f"Check that the env's observations match the observation space the policy was built for."
        )

    def _infer(self, ready: list[tuple[int, Any]]) -> None:
        t0 = time.perf_counter()
        n, values = len(ready), self._value_rows
        self._value_rows = []
        try:
            obs = tree_map(lambda x: x[:, None], tree_stack([obs for _, obs in ready] + [v[2] for v in values]))
        except Exception as exc:  # envs whose observations cannot be stacked: name them
            raise RunFailedError(self._batch_failure("stacking the observations", ready, exc)) from exc
        try:
            reply = self.inference.step(self._request(ready, values, obs))
            while reply.lost:  # a restarted server: the value rows' states are gone with the rest
                if self._server_id is None:
                    raise RunFailedError(
                        f"rollout worker {self.worker_id}: the inference server serves a later life of this "
                        f"worker than this one (incarnation {self.incarnation}); this life stops"
                    )
                self._memory_lost(values)
                values, obs = [], tree_map(lambda x: x[:n], obs)
                reply = self.inference.step(self._request(ready, values, obs))
        except RunFailedError:
            raise
        except Exception as exc:  # a wrong observation shape fails deep in the policy: name the envs
            raise RunFailedError(self._batch_failure("the policy's forward", ready, exc)) from exc
        self._server_id, self.version = reply.server_id, int(reply.version)  # the weights that chose the actions
        t1 = time.perf_counter()
        self.timers.add("perf/inference_ms", (t1 - t0) * 1e3)
        self.timers.add("perf/inference_batch", float(n))
        for j, (b, t, _) in enumerate(values):
            b.bootstrap[t] = reply.vpred[n + j]
            b.pending_bootstraps -= 1
            self._maybe_emit(self._slots[b.env_id], b)
        k = 0  # the wanted rows' index in reply.states
        for j, (i, env_obs) in enumerate(ready):
            slot = self._slots[i]
            if self._starts_fragment(slot):
                slot.builder = FragmentBuilder(
                    length=self.fragment_length,
                    stream=self._stream(slot),
                    index=slot.next_index,
                    worker_id=self.worker_id,
                    env_id=i,
                )
                slot.next_index += 1
                slot.builder.state_in = tree_map(lambda s: s[k : k + 1].copy(), reply.states)
                slot.builder.ref_state_in = tree_map(lambda s: s[k : k + 1].copy(), reply.ref_states)
                k += 1
            act = tree_map(lambda a: a[j, 0], reply.action)
            ref_logits = None if reply.ref_logits is None else tree_map(lambda x: x[j, 0], reply.ref_logits)
            slot.pending_t = slot.builder.record(
                obs=env_obs,
                action=act,
                logprob=reply.logprob[j],
                vpred=reply.vpred[j],
                first=slot.first,
                version=self.version,
                episode_id=slot.episode_id,
                ref_logits=ref_logits,
            )
            self.video.step(i, env_obs, float(reply.vpred[j]), slot.first)
            slot.first = False
            self._on_answers(self.pool.send_action(i, act))
        self.timers.add("perf/record_ms", (time.perf_counter() - t1) * 1e3)

    def _starts_fragment(self, slot: _Track) -> bool:
        # A builder still full here waits only for a bootstrap value of this batch, and is emitted before its
        # env's next step is recorded.
        return slot.builder is None or slot.builder.n >= self.fragment_length

    def _request(
        self, ready: list[tuple[int, Any]], values: list[tuple[FragmentBuilder, int, Any]], obs: Any
    ) -> StepRequest:
        rows = [i for i, _ in ready]
        return StepRequest(
            obs=obs,
            first=np.array([self._slots[i].first for i in rows] + [False] * len(values), bool),
            env_ids=np.array(rows + [b.env_id for b, _, _ in values], np.int64),
            n=len(rows),
            want=np.array([self._starts_fragment(self._slots[i]) for i in rows], bool),
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            server_id=self._server_id,
        )

    def _memory_lost(self, values: list[tuple[FragmentBuilder, int, Any]]) -> None:
        log.warning(
            "rollout worker %d: the inference server restarted and lost its envs' recurrent states; "
            "each env's memory restarts at its next step",
            self.worker_id,
        )
        self.memory_losses += 1
        self._server_id = None
        for slot in self._slots:
            slot.first = True
        for b, t, _ in values:  # the last value we have stands in, as for a lost env
            b.bootstrap[t] = b.vpred[t]
            b.pending_bootstraps -= 1
            self._maybe_emit(self._slots[b.env_id], b)

    def _maybe_emit(self, slot: _Track, b: FragmentBuilder) -> None:
        if not b.complete_fragment():
            return
        t0 = time.perf_counter()
        self._fragments.append(b.build())
        self.fragments_done += 1
        if slot.builder is b:
            slot.builder = None
        self.timers.add("perf/fragment_ms", (time.perf_counter() - t0) * 1e3)

    def _stream(self, slot: _Track) -> str:
        return stream_name(self.worker_id, self.incarnation, slot.env_id)
