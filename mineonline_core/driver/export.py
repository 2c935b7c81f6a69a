"""``mineonline export``: a checkpoint's deterministic action function as a file that runs without mineonline.

The exported function is what ``load_policy(RUN).predict(obs, state, episode_start=..., deterministic=True)``
computes: the adapted observation (one tensor per observation key, in the adapted space's dtype, batched
(N, ...)) in, the most likely action out. A recurrent policy's state travels as tensors too: the inputs
then also take the state the last call returned (one tensor per state leaf, batch first) and
``episode_start`` (N,) bool, which resets the state where an episode starts (at the first step any state of
the right shape, zeros say, with ``episode_start`` true), and the outputs add the next state. A JSON file
beside the export names every input and output with its dtype and shape.

TorchScript (``torch.jit.load``, Python or C++ libtorch) and ONNX (onnxruntime and every ONNX runtime)
are written; the ONNX file is checked by ``onnx.checker`` and run once against the policy before it is
kept, the TorchScript file is loaded back and run once the same way.
"""

from __future__ import annotations

import json
import logging
import pathlib
import warnings
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from mineonline_core.contracts.batch import Outputs
from mineonline_core.errors import ConfigError
from mineonline_core.services.episodes import LoadedPolicy

FORMATS = {"torchscript": ".pt", "onnx": ".onnx"}
# The batch sizes the exported function is traced and then checked at: different, so that a size baked in
# as a constant during tracing shows up as a mismatch instead of a file that works for one batch size only.
TRACE_BATCH, CHECK_BATCH = 2, 5


class DeterministicPolicy(nn.Module):
    """The policy's forward for one step of N envs and its most likely action, on tensors alone."""

    def __init__(self, loaded: LoadedPolicy) -> None:
        super().__init__()
        self.policy = loaded.policy
        for parameter in self.policy.parameters():  # outputs a caller can turn into arrays without torch.no_grad
            parameter.requires_grad_(False)
        space = loaded.observation_space
        self.keys = list(space.spaces)
        self.dtypes = {key: torch.from_numpy(np.zeros((), space[key].dtype)).dtype for key in self.keys}
        initial = self.policy.initial_state(1)
        leaves, self.state_spec = pytree.tree_flatten(initial) if initial is not None else ([], None)
        if initial is not None and not all(
            isinstance(leaf, torch.Tensor) and leaf.shape[:1] == (1,) for leaf in leaves
        ):
            raise ConfigError(
                f"{type(self.policy).__name__}'s recurrent state is not a tree of batch-first tensors; export "
                "takes feed-forward policies and recurrent ones whose state is. Fix: use load_policy(...).predict."
            )
        self.recurrent = initial is not None
        self.num_states = len(leaves)
        # The exported actions are what predict returns: a Box's float actions clipped to its bounds.
        bounds = loaded.action_space
        self.clip = isinstance(bounds, gym.spaces.Box) and np.issubdtype(bounds.dtype, np.floating)
        if self.clip:
            self.register_buffer("low", torch.as_tensor(bounds.low, dtype=torch.float32), persistent=False)
            self.register_buffer("high", torch.as_tensor(bounds.high, dtype=torch.float32), persistent=False)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        k = len(self.keys)
        obs = {key: tensors[i].to(self.dtypes[key])[:, None] for i, key in enumerate(self.keys)}
        reference = obs[self.keys[0]]
        if self.recurrent:
            # As predict with a state: ``first`` resets the state where an episode starts (the policy contract).
            state = pytree.tree_unflatten(list(tensors[k : k + self.num_states]), self.state_spec)
            first = tensors[-1].to(torch.bool)[:, None]
        else:
            # (N, 1) from the input's own batch size: a constant would fix the batch at the traced one.
            state, first = (
                None,
                torch.ones_like(reference.reshape(reference.shape[0], 1, -1)[:, :, 0], dtype=torch.bool),
            )
        latents, state = self.policy(input=obs, state_in=state, context={"first": first})
        action = self.policy.pi_head.sample(latents[Outputs.PI_LOGITS], deterministic=True)
        outputs = [leaf[:, 0] for leaf in pytree.tree_leaves(action)]
        if self.clip:
            outputs = [torch.minimum(torch.maximum(outputs[0], self.low), self.high)]
        if self.recurrent:
            outputs += pytree.tree_leaves(state)
        return tuple(outputs)

    def names(self, action_example: Any) -> tuple[list[str], list[str]]:
        """Input and output names: observation keys, ``state_in.i``, ``episode_start``; ``action`` (or
        ``action.<key>`` per leaf of a dict action), ``state_out.i``."""
        paths = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(action_example)[0]]
        actions = ["action"] if paths == [""] else ["action" + p.replace("['", ".").replace("']", "") for p in paths]
        states_in = [f"state_in.{i}" for i in range(self.num_states)]
        inputs = [*self.keys, *states_in, *(["episode_start"] if self.recurrent else [])]
        return inputs, [*actions, *(f"state_out.{i}" for i in range(self.num_states))]

    def example(self, loaded: LoadedPolicy, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Observations drawn from the space (finite), the initial state and every episode starting but one."""
        space = loaded.observation_space
        space.seed(seed)
        rows = [space.sample() for _ in range(batch)]
        obs = [
            torch.from_numpy(np.nan_to_num(np.stack([row[key] for row in rows]), posinf=1.0, neginf=-1.0))
            for key in self.keys
        ]
        if not self.recurrent:
            return tuple(obs)
        states = [s.expand(batch, *s.shape[1:]).clone() for s in pytree.tree_leaves(self.policy.initial_state(1))]
        start = torch.ones(batch, dtype=torch.bool)
        start[-1] = False
        return (*obs, *states, start)


def export_policy(path: str | pathlib.Path, *, fmt: str, output: str | pathlib.Path | None = None) -> dict[str, Any]:
    """Export the checkpoint at ``path`` (a run, save or checkpoint directory) to ``output``; returns what
    was written: the file, its signature file, the inputs and outputs with their dtypes and shapes."""
    from mineonline_core.driver.evaluate import find_checkpoint, load_policy

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not one of {sorted(FORMATS)}. Fix: --format torchscript or onnx.")
    checkpoint = find_checkpoint(path)
    target = pathlib.Path(output) if output else default_output(checkpoint, fmt)
    target.parent.mkdir(parents=True, exist_ok=True)
    loaded = load_policy(checkpoint)
    module = DeterministicPolicy(loaded).eval()
    example = module.example(loaded, TRACE_BATCH, seed=0)
    with torch.no_grad():
        outputs = module(*example)
        action_example = _predict(module, loaded, example)
        action_example = action_example[0] if module.recurrent else action_example
    inputs, names = module.names(action_example)
    if fmt == "torchscript":
        _torchscript(module, example, target)
    else:
        _onnx(module, example, target, inputs, names)
    _check(module, loaded, target, fmt, inputs)
    signature = {
        "format": fmt,
        "checkpoint": str(checkpoint),
        "iteration": loaded.iteration,
        "inputs": [_describe(name, t) for name, t in zip(inputs, example)],
        "outputs": [_describe(name, t) for name, t in zip(names, outputs)],
        "recurrent": module.recurrent,
    }
    sidecar = target.with_name(target.name + ".json")
    sidecar.write_text(json.dumps(signature, indent=2) + "\n")
    return {"file": str(target), "signature": str(sidecar), **signature}


def default_output(checkpoint: pathlib.Path, fmt: str) -> pathlib.Path:
    """``<run_dir>/export/<checkpoint name>.pt|.onnx`` (the run directory holds run.json), else ``./``."""
    run_dir = next((d for d in checkpoint.resolve().parents if (d / "run.json").is_file()), pathlib.Path("."))
    return run_dir / "export" / f"{checkpoint.name}{FORMATS[fmt]}"


def _describe(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": ["N", *tensor.shape[1:]]}


def _predict(module: DeterministicPolicy, loaded: LoadedPolicy, example: tuple[torch.Tensor, ...]) -> Any:
    """What ``load_policy(...).predict(..., deterministic=True)`` returns for ``example``: actions (and state)."""
    if not module.recurrent:
        return loaded.predict(_raw(module, example), deterministic=True)[0]
    k = len(module.keys)
    state = pytree.tree_unflatten(list(example[k:-1]), module.state_spec)
    return loaded.predict(_raw(module, example), state, episode_start=example[-1].numpy(), deterministic=True)


def _raw(module: DeterministicPolicy, example: tuple[torch.Tensor, ...]) -> dict[str, np.ndarray]:
    return {key: example[i].numpy() for i, key in enumerate(module.keys)}


def _torchscript(module: DeterministicPolicy, example: tuple[torch.Tensor, ...], target: pathlib.Path) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        # torch 2.13 marks torch.jit deprecated; TorchScript is still the one format libtorch (C++) loads.
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(module, example, check_trace=False)
        torch.jit.save(traced, str(target))


def _onnx(
    module: DeterministicPolicy,
    example: tuple[torch.Tensor, ...],
    target: pathlib.Path,
    inputs: list[str],
    outputs: list[str],
) -> None:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"ONNX export needs the onnx and onnxscript packages ({exc}). Fix: pip install 'mineonline-core[onnx]'"
        )
    batch = torch.export.Dim("batch")
    # The exporter logs a line per optional torchvision op it skips: noise to a user exporting a policy.
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                example,
                input_names=inputs,
                output_names=outputs,
                dynamic_shapes=(tuple({0: batch} for _ in example),),  # forward(*tensors): one varargs entry
                dynamo=True,
                verbose=False,
            )
    finally:
        registration.setLevel(level)
    program.save(str(target))


def _check(module: DeterministicPolicy, loaded: LoadedPolicy, target: pathlib.Path, fmt: str, names: list[str]) -> None:
    """Run the written file on a batch of another size; its actions must be ``predict``'s."""
    example = module.example(loaded, CHECK_BATCH, seed=1)
    with torch.no_grad():
        if fmt == "torchscript":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                got = [o.numpy() for o in torch.jit.load(str(target))(*example)]
        else:
            import onnx
            from onnx.reference import ReferenceEvaluator

            onnx.checker.check_model(str(target))
            feeds = {name: t.numpy() for name, t in zip(names, example)}
            try:
                import onnxruntime
            except ImportError:
                got = ReferenceEvaluator(str(target)).run(None, feeds)
            else:
                got = onnxruntime.InferenceSession(str(target), providers=["CPUExecutionProvider"]).run(None, feeds)
    expected = [np.asarray(leaf) for leaf in pytree.tree_leaves(_predict(module, loaded, example))]
    for want, have in zip(expected, got):
        if want.shape != have.shape or not np.allclose(want, have, rtol=1e-4, atol=1e-5):
            raise ConfigError(
                f"the exported {fmt} file {str(target)!r} does not reproduce the policy on a batch of {CHECK_BATCH} "
                "(its tracing missed a step that depends on the input). Fix: report this with the policy's class."
            )
