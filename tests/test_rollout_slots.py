"""Rollout inference keeps every env's recurrent states where it runs (issue 33, rows 2, 5, 6): no Ray here.
The collector's host copies of state are counted per step; the shared server (used as a plain object, its batch
thread real) is checked against a plain step-by-step loop: its slots per worker, the reset at ``first`` and at a
worker's new life, the ``lost`` answer of a restarted server, and states returned in the policy's dtype under
bfloat16 autocast."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.policy import CategoricalHead
from mineonline_core.rollout.collector import FragmentCollector
from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.rollout.localpolicy import LocalPolicy
from mineonline_core.rollout.stepping import StateSlots, StepReply, StepRequest
from mineonline_core.testing import kit as tk

#: Tensor methods that, on a GPU, make the host wait for the device (besides ``cpu``, counted apart).
_SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "__array__"}


class HostCopies(TorchFunctionMode):
    """Every ``Tensor.numpy`` call (where a tensor's data reaches numpy on the host) and every ``Tensor.cpu``,
    with their shapes, and every other call that would wait for a GPU (``syncs``): on the CPU these cost nothing,
    so only counting them shows a sync that a GPU would pay at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.cpu_shapes: list[tuple[int, ...]] = []
        self.syncs: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = getattr(func, "__name__", "")
        if func is torch.Tensor.numpy:
            self.shapes.append(tuple(args[0].shape))
        elif func is torch.Tensor.cpu:
            self.cpu_shapes.append(tuple(args[0].shape))
        elif name in _SYNCS and args and isinstance(args[0], torch.Tensor):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_states_reach_the_host_only_at_fragment_starts_and_outputs_in_one_copy() -> None:
    """Row 2: per step one host copy of the outputs; the policy's and the reference's states (width 8) only
    for the envs whose fragment starts at that step, one row each; no other host sync (``.item()``,
    ``bool(t)``, ``float(t)``, ``.tolist()``, ``nonzero``...) in a step."""
    torch.manual_seed(0)
    policy, reference = tk.TinyGRUPolicy(), tk.TinyGRUPolicy()
    c = tk.collector(
        policy=policy,
        env_fns=[functools.partial(tk.counting, i, episode_len=7) for i in range(3)],
        fragment_length=5,
        batch_size=2,
        env_processes=False,  # the envs step in this thread: every tensor call of a step is seen
    )
    c.set_reference({k: v.numpy() for k, v in reference.state_dict().items()})
    starts_seen = steps_with_start = 0
    try:
        c.warmup(timeout=120)
        while c.fragments_done < 12:
            before = sum(slot.next_index for slot in c._slots)
            with HostCopies() as copies:
                c.step()
            starts = sum(slot.next_index for slot in c._slots) - before
            state_rows = [shape[0] for shape in copies.shapes if shape[1:] == (8,)]
            assert len(copies.shapes) - len(state_rows) == 1  # actions, log-probs and values together
            # Each copy reaches numpy through one .cpu() (a device tensor has no .numpy()), and nothing else waits.
            assert copies.cpu_shapes == copies.shapes and copies.syncs == []
            assert state_rows == ([starts, starts] if starts else [])  # the policy's and the reference's
            starts_seen += starts
            steps_with_start += bool(starts)
        frags = c.pop_fragments()
    finally:
        c.close()
    assert starts_seen >= 12 and steps_with_start < c.env_steps  # most steps copied no state
    assert all(f[F.REF_STATE_IN][0].shape == (1, 8) and f[F.STATE_IN][0].dtype == np.float32 for f in frags)


def _server(policy_generator: Any, *, precision: PrecisionChoice = PrecisionChoice()) -> InferenceServer:
    """A server object (no actor) holding ``policy_generator()``'s weights as version 1, with a reference."""
    server = InferenceServer(
        policy_generator=policy_generator, config=tk.rollout_config(num_envs=3), precision=precision
    )
    torch.manual_seed(7)
    server.reference = policy_generator().eval()
    server.version = 1
    server._loaded.set()
    return server


def _request(worker: int, env_ids: list[int], first: list[bool], want: list[bool], seed: int, **keys: Any):
    obs = np.random.default_rng(seed).normal(size=(len(env_ids), 1, 3)).astype(np.float32)
    return StepRequest(
        obs={"obs": obs},
        first=np.array(first, bool),
        env_ids=np.array(env_ids, np.int64),
        n=len(env_ids),
        want=np.array(want, bool),
        worker_id=worker,
        **keys,
    )


def _plain(policy: nn.Module, req: StepRequest, state: torch.Tensor, action: np.ndarray):
    """The plain forward: log-probs of ``action`` and the state after the step."""
    with torch.no_grad():
        latents, (h,) = policy(
            input={"obs": torch.as_tensor(req.obs["obs"])},
            state_in=[state],
            context={"first": torch.as_tensor(req.first)[:, None]},
        )
    logprob = policy.pi_head.logprob(torch.as_tensor(action), latents["pi_logits"]).reshape(-1)
    return logprob.numpy(), h


def test_the_server_keeps_each_workers_states_and_resets_them_at_first_and_new_lives() -> None:
    """Row 5: requests carry no state; a plain loop that carries each env's state reproduces the server's
    log-probs step after step, for two workers with the same env ids; states come back only where asked,
    as they were before the step (initial at ``first``); a worker's new life starts from initial states; a
    request naming another server (the one before a restart) is answered ``lost`` and runs nothing."""
    server = _server(tk.TinyGRUPolicy)
    policy, reference = server.policy, server.reference
    try:
        h = {w: torch.zeros(2, 8) for w in (0, 1)}  # the plain loop's states of envs 0 and 2
        ref_h = {w: torch.zeros(2, 8) for w in (0, 1)}
        for t in range(3):
            first = [t == 0, t == 2]  # env 2 starts a new episode at t == 2: its slot is reset there
            replies = {w: server.step(_request(w, [0, 2], first, [t != 1, t != 1], seed=10 * t + w)) for w in (0, 1)}
            for w, reply in replies.items():
                req = _request(w, [0, 2], first, [], seed=10 * t + w)
                state_in = torch.where(torch.as_tensor(first)[:, None], torch.zeros(2, 8), h[w])
                ref_in = torch.where(torch.as_tensor(first)[:, None], torch.zeros(2, 8), ref_h[w])
                logprob, h[w] = _plain(policy, req, state_in, reply.action)
                _, ref_h[w] = _plain(reference, req, ref_in, reply.action)
                np.testing.assert_allclose(reply.logprob, logprob, atol=1e-6)
                if t != 1:  # at t == 2 env 0's state is two steps old, env 2's the initial one
                    np.testing.assert_array_equal(reply.states[0], state_in.numpy())
                    np.testing.assert_array_equal(reply.ref_states[0], ref_in.numpy())
                else:
                    assert reply.states is None and reply.ref_states is None
                assert reply.version == 1 and reply.server_id == server.server_id and not reply.lost
        assert h[0].abs().sum() > 0 and not torch.equal(h[0], h[1])  # the workers' slots are apart

        # Worker 1's new life: its slots hold initial states again, even for a step without ``first``.
        reply = server.step(_request(1, [0], [False], [True], seed=99, incarnation=1, server_id=server.server_id))
        np.testing.assert_array_equal(reply.states[0], np.zeros((1, 8), np.float32))
        # A request of its previous life, and one naming another server: lost, and nothing ran.
        forwards = server.metrics()["rollout/inference_forwards"]
        for keys in ({"incarnation": 0}, {"incarnation": 1, "server_id": "an-earlier-server"}):
            reply = server.step(_request(1, [0], [False], [False], seed=5, **keys))
            assert reply.lost and reply.server_id == server.server_id and reply.action is None
        assert server.metrics()["rollout/inference_forwards"] == forwards
    finally:
        server.shutdown()


class LinearGRUPolicy(tk.TinyGRUPolicy):
    """A GRU whose gates are ``nn.Linear``: under CPU bfloat16 autocast its state comes out in bfloat16, as a
    ``GRUCell``'s does under CUDA autocast (CPU autocast leaves ``GRUCell`` in float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates = nn.Linear(16, 24)

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = torch.tanh(self.inp(input["obs"].float()))
        h, outs = state_in[0], []
        for t in range(x.shape[1]):
            h = torch.where(context["first"][:, t, None], torch.zeros_like(h), h)
            h = h.to(x.dtype)  # the computing dtype: bfloat16 under autocast
            z, r, n = self.gates(torch.cat([x[:, t], h], -1)).chunk(3, -1)
            h = (1 - torch.sigmoid(z)) * torch.tanh(n * torch.sigmoid(r)) + torch.sigmoid(z) * h
            outs.append(h)
        y = torch.stack(outs, 1)
        return {"pi_logits": self.pi_head(y).float(), "vpred": self.value_head(y).float()}, [h]


def test_bfloat16_autocast_states_return_and_stay_in_the_policys_dtype() -> None:
    """Row 6 (the server's cast): under bfloat16 autocast the state after a step is bfloat16; the slots keep
    float32 (initial_state's dtype) and a fragment start receives float32 numpy."""
    probe = LinearGRUPolicy()
    with torch.no_grad(), PrecisionChoice(use_amp=True, amp_dtype="bfloat16").on("cpu").autocast():
        _, (h,) = probe(
            input={"obs": torch.zeros(1, 1, 3)},
            state_in=[torch.zeros(1, 8)],
            context={"first": torch.ones(1, 1, dtype=torch.bool)},
        )
    assert h.dtype == torch.bfloat16  # what the server must cast back
    server = _server(LinearGRUPolicy, precision=PrecisionChoice(use_amp=True, amp_dtype="bfloat16"))
    try:
        server.step(_request(0, [0, 1], [True, True], [True, True], seed=1))
        reply = server.step(_request(0, [1, 0], [False, False], [True, False], seed=2))
        (slots,) = [s for _, s in server._slots.values()]
        assert slots.state[0].dtype == torch.float32 and slots.ref[0].dtype == torch.float32
        assert reply.states[0].dtype == np.float32 and reply.ref_states[0].dtype == np.float32
        assert reply.states[0].shape == (1, 8) and np.abs(reply.states[0]).sum() > 0  # env 1 after one step
    finally:
        server.shutdown()


class RestartingServer:
    """A shared server stand-in: a ``LocalPolicy`` whose slots are lost at call ``restart_at`` (a new server
    id), answering ``lost`` to requests that name the old one, as a restarted ``InferenceServer`` does."""

    def __init__(self, local: LocalPolicy, restart_at: int) -> None:
        self.local, self.restart_at, self.calls, self.server_id = local, restart_at, 0, "life-0"

    def step(self, request: StepRequest) -> StepReply:
        self.calls += 1
        if self.calls == self.restart_at:
            self.server_id = "life-1"
            slots = self.local.slots
            self.local.slots = StateSlots(
                initial_state=self.local.policy.initial_state, num_envs=slots.num_envs, device=slots.device
            )
        if request.server_id not in (None, self.server_id):
            return StepReply(lost=True, server_id=self.server_id)
        reply = self.local.step(request)
        reply.server_id = self.server_id
        return reply


def test_a_server_that_lost_the_states_restarts_each_envs_memory_and_rollout_still_replays() -> None:
    """After a restart the next step of every env carries ``first`` (mid-episode), so the training forward
    from each fragment's ``STATE_IN`` still reproduces every recorded log-prob; the bootstrap values owed
    (a time limit of 5 steps) fall back on the truncated steps' own values."""
    torch.manual_seed(0)
    policy = tk.TinyGRUPolicy()
    local = LocalPolicy(policy=policy, device=torch.device("cpu"), precision=PrecisionChoice().on("cpu"), num_envs=2)
    server = RestartingServer(local, restart_at=12)
    c = FragmentCollector(  # a collector of shared inference: no policy of its own
        policy=None,
        env_fns=[functools.partial(tk.time_limited_counting, i) for i in range(2)],
        config=tk.rollout_config(num_envs=2, fragment_length=7, batch_size=2, env_processes=False),
        inference=server,
    )
    try:
        frags = c.collect(8)
    finally:
        c.close()
    assert c.memory_losses == 1 and c.metrics()["rollout/inference_memory_losses"] == 1.0
    counters, firsts = chain(frags, F.OBS)[:, 1], chain(frags, F.FIRST)
    assert (firsts & (counters != 0)).any()  # a memory restart inside an episode
    with torch.no_grad():
        for f in frags:
            latents, _ = policy(
                input={"obs": torch.as_tensor(f[F.OBS]["obs"])[None]},
                state_in=[torch.as_tensor(f[F.STATE_IN][0])],
                context={"first": torch.as_tensor(f[F.FIRST])[None]},
            )
            logprob = policy.pi_head.logprob(torch.as_tensor(f[F.ACTION])[None], latents["pi_logits"])[0]
            np.testing.assert_allclose(logprob.numpy(), f[F.LOGPROB], atol=1e-5)


def chain(frags: list[dict], column: str) -> np.ndarray:
    return np.concatenate([f[column]["obs"] if column == F.OBS else f[column] for f in frags])


class HalfActionHead(CategoricalHead):
    """Samples its actions as bfloat16 floats, as a continuous head computing under bfloat16 autocast does."""

    def sample(self, logits: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        return super().sample(logits, deterministic).to(torch.bfloat16)


def test_bfloat16_actions_reach_the_env_as_float32() -> None:
    """numpy has no bfloat16: an action sampled in it is sent (and stored) as float32, every value kept."""
    torch.manual_seed(0)
    policy = tk.TinyGRUPolicy()
    policy.pi_head = HalfActionHead(8, 2)
    local = LocalPolicy(policy=policy, device=torch.device("cpu"), precision=PrecisionChoice().on("cpu"), num_envs=3)
    reply = local.step(_request(0, [0, 1, 2], [True] * 3, [True] * 3, seed=3))
    assert reply.action.dtype == np.float32 and reply.action.shape == (3, 1)
    assert set(np.unique(reply.action)) <= {0.0, 1.0}
    np.testing.assert_allclose(
        reply.logprob,
        _plain(policy, _request(0, [0, 1, 2], [True] * 3, [], 3), torch.zeros(3, 8), reply.action)[0],
        atol=1e-6,
    )
