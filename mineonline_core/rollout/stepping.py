"""One inference interface for the collector, whichever process runs the policy.

``FragmentCollector`` sends a ``StepRequest`` (host data only: observations, ``first`` flags, env ids, which
rows start a fragment) to an ``Inference``: ``LocalPolicy`` (``inference: local``, in the worker) or
``InferenceClient`` (``inference: shared``, the server actor). Both run ``run_batch`` below over ``StateSlots``:
every env's recurrent state (the policy's and the KL reference's) lives in its slot on the inference device.

Why the states stay there: at VPT-2x one env's states weigh 16 MiB, and only a fragment's first step (1 in
``fragment_length``) has to store them (``STATE_IN``, ``REF_STATE_IN``). So a step sends observations to the device
and brings back one small packed tensor of actions, log-probs and values; states cross to the host only for the rows
that start a fragment, and are returned in the dtype of the policy's ``initial_state`` (an autocast forward may
give its state in bfloat16).

Slot rules (the policy contract, ``contracts/policy.py``): a row with ``first`` runs from the initial state (the
policy resets there anyway, and the fragment's stored state then equals the training side's); value-only rows (the
bootstrap value of a truncated episode's final observation) read the state the env reached and write nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.tree import tree_cat, tree_leaves, tree_map


@dataclass
class StepRequest:
    """Rows ``[0, n)`` choose actions for envs ``env_ids[:n]``; rows ``[n, B)`` are value-only rows of envs
    ``env_ids[n:]``. ``want[j]`` (action rows) asks for row ``j``'s states before the step."""

    obs: Any  # numpy tree, leaves (B, 1, ...)
    first: np.ndarray  # bool (B,); False on value rows
    env_ids: np.ndarray  # int64 (B,)
    n: int
    want: np.ndarray  # bool (n,)
    worker_id: int = 0
    incarnation: int = 0
    server_id: str | None = None  # the server that holds this worker's slots, None before the first reply


@dataclass
class StepReply:
    action: Any = None  # numpy tree, leaves (n, 1, ...)
    logprob: np.ndarray | None = None  # float32 (n,)
    vpred: np.ndarray | None = None  # float32 (B,), value rows included
    states: Any = None  # the policy's states before the step of the wanted rows, (k, ...), or None
    ref_states: Any = None  # the reference's, or None without a reference
    ref_logits: Any = None  # numpy tree, leaves float32 (n, 1, ...): the reference's logits, or None without one
    version: int | None = None  # the weights that chose the actions
    lost: bool = False  # the server no longer holds this worker's states (it was restarted): nothing ran
    server_id: str | None = None


class Inference(Protocol):
    def step(self, request: StepRequest) -> StepReply: ...


def policy_step(policy: Any, obs: Any, state: Any, first: Any) -> tuple[Any, Any, Any, Any]:
    """One batched rollout forward (call under ``torch.no_grad``): sampled action, its log-prob,
    the denormalised value and the state after the step."""
    latents, state_out = policy(input=obs, state_in=state, context={"first": first})
    pi_logits, rows = latents[Outputs.PI_LOGITS], first.shape[0]
    action = policy.pi_head.sample(pi_logits)
    logprob = policy.pi_head.logprob(action, pi_logits).reshape(rows)
    vpred = policy.value_head.denormalize(latents[Outputs.VPRED]).reshape(rows)
    return action, logprob, vpred, state_out


def _on(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda x: torch.as_tensor(x).to(device, non_blocking=True), tree)


class StateSlots:
    """The recurrent states of ``num_envs`` envs on ``device``, in the dtypes of ``initial_state``; the
    reference's from ``start_reference`` on (a reference that replaces another keeps the states reached)."""

    def __init__(self, *, initial_state: Callable[[int], Any], num_envs: int, device: torch.device) -> None:
        self.num_envs, self.device = num_envs, device
        self.init = _on(initial_state(1), device)
        self.state = _on(initial_state(num_envs), device)
        self.ref_init: Any = None
        self.ref: Any = None

    def start_reference(self, initial_state: Callable[[int], Any]) -> None:
        if self.ref is None:
            self.ref_init = _on(initial_state(1), self.device)
            self.ref = _on(initial_state(self.num_envs), self.device)


def _gather(full: Any, init: Any, idx: torch.Tensor, reset: torch.Tensor) -> Any:
    """Rows ``idx`` of ``full``, the initial state where ``reset``: a device copy, never a view of a slot."""

    def pick(s: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.where(reset.view(-1, *[1] * (s.dim() - 1)), i, s.index_select(0, idx))

    return tree_map(pick, full, init)


def _scatter(full: Any, idx: torch.Tensor, new: Any) -> None:
    # Autocast may give the state in a lower precision; the slot keeps initial_state's dtype.
    tree_map(lambda s, x: s.index_copy_(0, idx, x.to(s.dtype)), full, new)


def _wanted(tree: Any, rows: torch.Tensor | None, like: Any) -> Any:
    """The wanted rows of a gathered state, in ``like``'s dtypes, still on the device (taken before the forward,
    so a policy that writes its ``state_in`` in place cannot change what the fragment stores)."""
    if rows is None or tree is None:
        return None
    return tree_map(lambda s, i: s.index_select(0, rows).to(i.dtype), tree, like)


def _host(tree: Any) -> Any:
    # Only at a fragment's first step, and after the step's one wait: the stream is idle by then.
    return tree_map(lambda s: s.cpu().numpy(), tree)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    # numpy has no bfloat16: a continuous action sampled under bfloat16 autocast goes to the env (and the
    # fragment) as float32, which holds its every value exactly.
    return np.dtype(np.float32) if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))


def _pack(action: Any, logprob: torch.Tensor, vpred: torch.Tensor) -> tuple[torch.Tensor, list]:
    """One (B, k) float64 tensor, so a step brings its outputs to the host in one copy (float64 holds float32
    values and integer actions below 2**53 exactly)."""
    rows = logprob.shape[0]
    leaves = tree_leaves(action)
    cols = [logprob.reshape(rows, 1), vpred.reshape(rows, 1), *(a.reshape(rows, -1) for a in leaves)]
    spec = [(a.shape[1:], _numpy_dtype(a.dtype)) for a in leaves]
    return torch.cat([c.to(torch.float64) for c in cols], 1), spec


def _columns(flat: np.ndarray, like: Any, shapes: list, start: int = 0) -> Any:
    """The leaves of ``like``'s tree rebuilt from consecutive column spans of ``flat`` (rows, columns),
    one span per leaf shape, from column ``start``."""
    rows, col, leaf = flat.shape[0], start, iter(shapes)

    def rebuild(_: Any) -> np.ndarray:
        nonlocal col
        shape = next(leaf)
        width = int(np.prod(shape, dtype=np.int64))
        out = flat[:, col : col + width].reshape(rows, *shape)
        col += width
        return out

    return tree_map(rebuild, like)


def _unpack(host: np.ndarray, spec: list, action: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    leaves = iter(dtype for _, dtype in spec)
    action = tree_map(lambda a: a.astype(next(leaves)), _columns(host, action, [shape for shape, _ in spec], 2))
    return action, host[:, 0].astype(np.float32), host[:, 1].astype(np.float32)


def _pack_ref(logits: Any, rows: torch.Tensor, total: int) -> tuple[torch.Tensor, list]:
    """The reference's float32 logits (one row per action row) as float64 columns of ``total`` rows, bit for bit
    (two float32 values in one float64's bits), so they ride in the step's one host copy at float32's size."""
    leaves = [x.float().reshape(x.shape[0], -1) for x in tree_leaves(logits)]
    spec = [tuple(x.shape[1:]) for x in tree_leaves(logits)]
    flat = torch.cat(leaves, 1)
    if flat.shape[1] % 2:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], 1)], 1)
    block = flat.new_zeros(int(total), flat.shape[1]).index_copy_(0, rows, flat)
    return block.view(torch.float64), spec


def _unpack_ref(block: np.ndarray, spec: list, like: Any) -> Any:
    return _columns(np.ascontiguousarray(block).view(np.float32), like, spec)


def run_batch(
    *, policy: Any, reference: Any, precision: Any, device: torch.device, parts: list[tuple[StateSlots, StepRequest]]
) -> list[StepReply]:
    """One forward over the rows of every request (call under ``torch.no_grad``), each request's envs in its own
    ``StateSlots``; returns the replies in order (``version`` unset)."""
    gathered = []
    for slots, req in parts:
        idx = torch.as_tensor(np.asarray(req.env_ids, np.int64)).to(device, non_blocking=True)
        first = torch.as_tensor(np.asarray(req.first, bool)).to(device, non_blocking=True)
        if reference is not None and req.n:
            slots.start_reference(reference.initial_state)
        state = _gather(slots.state, slots.init, idx, first)
        ref_state = _gather(slots.ref, slots.ref_init, idx[: req.n], first[: req.n]) if reference is not None else None
        want = np.flatnonzero(req.want)
        rows = torch.as_tensor(want).to(device, non_blocking=True) if len(want) else None
        keep = (_wanted(state, rows, slots.init), _wanted(ref_state, rows, slots.ref_init))
        gathered.append((idx, first, state, ref_state, keep, rows))
    obs = tree_cat([_on(req.obs, device) for _, req in parts])
    first = torch.cat([g[1] for g in gathered])[:, None]
    with precision.autocast():
        action, logprob, vpred, state_out = policy_step(policy, obs, tree_cat([g[2] for g in gathered]), first)
    packed, spec = _pack(action, logprob, vpred)
    starts = np.cumsum([0] + [len(req.first) for _, req in parts])
    ref_parts = [(j, req.n) for j, (_, req) in enumerate(parts) if reference is not None and req.n]
    ref_out = ref_logits = None
    if ref_parts:
        ref_obs = tree_cat([tree_map(lambda x: x[starts[j] : starts[j] + n], obs) for j, n in ref_parts])
        ref_first = torch.cat([gathered[j][1][:n] for j, n in ref_parts])[:, None]
        ref_in = tree_cat([gathered[j][3] for j, _ in ref_parts])
        with precision.autocast():
            ref_latents, ref_out = reference(input=ref_obs, state_in=ref_in, context={"first": ref_first})
        # Kept with the fragment so that training need not run the reference again; float32
        # holds an autocast forward's bfloat16 or float16 logits exactly.
        ref_logits = ref_latents[Outputs.PI_LOGITS]
        pos = np.concatenate([np.arange(starts[j], starts[j] + n) for j, n in ref_parts])
        ref_block, ref_spec = _pack_ref(ref_logits, torch.as_tensor(pos).to(device, non_blocking=True), starts[-1])
        width = packed.shape[1]
        packed = torch.cat([packed, ref_block], 1)
    ref_row = 0
    for j, (slots, req) in enumerate(parts):
        if not req.n:
            continue
        idx, rows = gathered[j][0][: req.n], slice(starts[j], starts[j] + req.n)
        _scatter(slots.state, idx, tree_map(lambda x: x[rows], state_out))
        if ref_out is not None:
            own = slice(ref_row, ref_row + req.n)
            _scatter(slots.ref, idx, tree_map(lambda x: x[own], ref_out))
            ref_row += req.n
    # The step's one wait on the device: every output in one copy.
    host = packed.cpu().numpy()
    action_np, logprob_np, vpred_np = _unpack(host, spec, action)
    ref_np = None if ref_logits is None else _unpack_ref(host[:, width:], ref_spec, ref_logits)
    replies = []
    for j, (_, req) in enumerate(parts):
        lo, (states, ref_states) = starts[j], gathered[j][4]
        own_logits = None if ref_np is None or not req.n else tree_map(lambda x: x[lo : lo + req.n], ref_np)
        replies.append(
            StepReply(
                action=tree_map(lambda x: x[lo : lo + req.n], action_np),
                logprob=logprob_np[lo : lo + req.n],
                vpred=vpred_np[lo : starts[j + 1]],
                states=_host(states),
                ref_states=_host(ref_states),
                ref_logits=own_logits,
            )
        )
    return replies
