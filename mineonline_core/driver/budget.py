"""How much memory a run needs, estimated from the config before anything large is allocated.

The policy is built on PyTorch's ``meta`` device, which records shapes and allocates nothing, so
``policy_config: {hidden_sizes: [1000000000]}`` is measured (13e9 parameters) instead of allocated
until the kernel kills the process. The estimate adds, per process kind:

* each trainer rank: the weights, their gradients, Adam's two moments, and the KL reference when the
  trainer keeps one (``Algorithm.has_reference``); and the chunks it holds: this iteration's
  (``batches_per_iteration`` micro-batches of ``batch_size_per_gpu`` chunks, with the estimate's
  columns) and the next ``prefetch_batches`` iterations' chunks, fetched ahead;
* each rollout worker: two copies of the weights (live and standby), three with a KL reference, and
  the fragment each env is filling (``fragment_length`` steps, allocated when it starts); the
  driver: one copy of the weights for its check; the evaluation actor (``eval_interval``): one, and its env;
* the in-memory replay store: ``max_chunks x fragments_per_chunk`` fragments of
  ``fragment_length`` steps (observation, action and six float32 per-step columns) plus the
  recurrent state before each fragment, twice with a KL reference (``ref_state_in``: a VPT-2x
  fragment carries 8 MiB of each); an on-disk store is bounded by its disk, not by memory;
* a fixed size per process: what benchmarks/RESULTS.md measured, rounded down (a Ray actor with
  torch imported holds 305-470 MiB resident; an env subprocess 190-227 MiB, mostly pages shared
  with the forkserver), and Ray's own daemons.

Activations and allocator slack are not counted (they depend on batch shapes: VPT-1x training peaks
at 9.2 GiB for 284 MiB of weights); they scale with the micro-batch (``batch_size_per_gpu`` chunks of
``context_length`` steps), not with the iteration. So the estimate is a lower bound: a config refused
here cannot fit, while one accepted may still need more.

``check`` refuses a run whose estimate exceeds the machine's memory (the cgroup limit when lower);
when the part that grows with ``fragment_length`` is what does not fit, it names that key and the
longest fragment that fits. ``check_policy_fits`` refuses a policy the driver's own check could not
build, and a fragment no single process here could hold (``fragment_length`` of 400 digits).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable

from mineonline_core.errors import ConfigError

GiB = 2**30
PROCESS_BYTES = 300 * 2**20  # a Ray actor with torch imported (measured 305-470 MiB resident)
BOOKKEEPING_ACTORS = 6  # manager, replay buffer, store host, statistics, logger hub, train controller
ENV_PROCESS_BYTES = 64 * 2**20  # an env subprocess beyond the pages it shares with the forkserver
RAY_BYTES = 512 * 2**20  # GCS, raylet, log monitor, dashboard agent
STEP_COLUMNS_BYTES = 6 * 4  # reward, log-prob, value, first, terminated, truncated (float32 or less)
USUAL_FRAGMENT_LENGTH = 256  # MineStudio's default fragment_length
BUILDER_COLUMNS_BYTES = 4 * 4 + 3 + 2 * 8  # a fragment being filled: 4 float32, 3 bool, 2 int64 columns
ESTIMATE_COLUMNS_BYTES = 4 * 4  # staleness, value, advantage, return: added to the iteration's batch
TRAINER_COPIES = 4  # weights, gradients, two Adam moments (+1 for a KL reference)
ROLLOUT_COPIES = 2  # the live weights and the standby copy a broadcast is loaded into (+1 for a KL reference)


def meta_policy(policy_generator: Callable[[], Any]) -> Any | None:
    """The policy built on the ``meta`` device (shapes only, nothing allocated); None when the
    generator cannot build there (it computes with its weights, say) and only a real build can tell."""
    import warnings

    import torch

    try:
        # A generator that loads weights copies them into meta parameters, a no-op torch warns about.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return policy_generator()
    except Exception:  # noqa: BLE001 - any failure means "unknown here"; the real build reports errors
        return None


def _tensor_bytes(tree: Any) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _space_bytes(space: Any) -> int:
    """Bytes of one sample of a gymnasium space (0 for what it cannot tell)."""
    spaces = getattr(space, "spaces", None)
    if isinstance(spaces, dict):
        return sum(_space_bytes(s) for s in spaces.values())
    if isinstance(spaces, (list, tuple)):
        return sum(_space_bytes(s) for s in spaces)
    shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
    if shape is None or dtype is None:
        return 0
    return int(math.prod(shape)) * dtype.itemsize


def machine_memory() -> tuple[int, str]:
    """Bytes of memory this machine gives the run, and where the figure comes from."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit_file = Path("/sys/fs/cgroup/memory.max")
    try:
        limit = limit_file.read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and int(limit) < total:
        return int(limit), f"the container's limit ({limit_file})"
    return total, "the machine's physical memory"


def available_memory() -> int:
    """Bytes that can be allocated now without swapping (``MemAvailable``), else the machine's memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(int(line.split()[1]) * 1024, machine_memory()[0])
    except (OSError, ValueError, IndexError):
        pass
    return machine_memory()[0]


def _gib(n: float) -> str:
    if n >= 2**100 * GiB:  # beyond a float's range for a key of hundreds of digits
        return f"about 10^{len(str(int(n) // GiB)) - 1} GiB"
    return f"{n / GiB:.1f} GiB"


def _count(n: int) -> str:
    text = str(n)
    return text if len(text) <= 20 else f"{text[:6]}... ({len(text)} digits)"


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes each part of a run needs; ``policy`` is the meta-device policy (None when unknown)."""

    policy: Any | None
    parameters: int
    policy_bytes: int
    parts: dict[str, int]
    policy_text: str
    fragment_length: int = 0
    step_bytes: int = 0  # bytes of all parts together per step of fragment_length
    env_fragment_bytes: int = 0  # one env's fragment being filled: one process holds it whole
    gpu: Any = None  # gpu_budget.GpuEstimate of a trainer rank's card, when training runs on a GPU

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        params = (
            f"{self.parameters:,} parameters ({_gib(self.policy_bytes)})" if self.policy is not None else "unknown size"
        )
        return f"about {_gib(self.total)}: policy {params}; " + "; ".join(
            f"{k} {_gib(v)}" for k, v in self.parts.items()
        )

    def check_policy_fits(self, available: int | None = None) -> None:
        """Refuse a policy larger than this process could build (before it is built), and one env's
        fragment larger than any process here could hold."""
        available = available if available is not None else available_memory()
        if self.env_fragment_bytes > available:
            raise ConfigError(
                f"rollout_config.fragment_length: {_count(self.fragment_length)} steps make one env's fragment "
                f"{_gib(self.env_fragment_bytes)}, more than the {_gib(available)} of memory available here, so no "
                "rollout worker could hold it. Fix: set fragment_length to a few hundred steps (MineStudio's configs "
                "use 128-256); train_config.context_length sets how far back training sees."
            )
        if self.policy is None:
            return
        if self.policy_bytes > available:
            raise ConfigError(
                f"{self.policy_text}: the policy has {self.parameters:,} parameters, "
                f"{_gib(self.policy_bytes)} as built, more than the {_gib(available)} of memory available here, "
                "so building it would exhaust memory. Fix: make the network smaller (e.g. policy_config.hidden_sizes), "
                "or check the config on a machine that can hold it."
            )

    def check(self, available: int, where: str) -> None:
        """Refuse a run whose estimate exceeds ``available`` bytes, or whose trainer's GPU part exceeds
        the memory of the GPUs this machine has (``gpu_budget.py``)."""
        if self.gpu is not None:
            self.gpu.check()
        if self.total <= available:
            return
        rest = self.total - self.step_bytes * self.fragment_length
        longest = (available - rest) // self.step_bytes if self.step_bytes else 0
        # Named when a usual length would fit and this one does not: then the length is what is wrong.
        if min(self.fragment_length, USUAL_FRAGMENT_LENGTH) <= longest < self.fragment_length:
            raise ConfigError(
                f"rollout_config.fragment_length: {_count(self.fragment_length)} steps make the run need "
                f"{self.describe()}, but {where} is {_gib(available)}: at most {longest:,} steps per fragment fit. "
                "Fix: lower fragment_length (MineStudio's configs use 128-256; train_config.context_length sets how "
                "far back training sees), lower rollout_config.replay_buffer_config.max_chunks, or run on a larger "
                "machine or a cluster (--address)."
            )
        if self.total > available:
            raise ConfigError(
                f"The run needs {self.describe()}, but {where} is {_gib(available)}. Fix: shrink the policy "
                f"({self.policy_text}), lower rollout_config.replay_buffer_config.max_chunks or fragment_length (an "
                "in-memory store holds every chunk), run fewer rollout workers, envs or trainer ranks, or give the "
                "run a larger machine or a cluster (--address)."
            )


def estimate_memory(
    cfg: Any,
    policy_generator: Callable[[], Any],
    observation_space: Any,
    action_space: Any,
    store_cls: type,
    *,
    reference: bool = False,
) -> MemoryEstimate:
    """Estimate the memory ``cfg`` needs on one machine, building the policy on the meta device only.
    ``reference``: the trainer keeps a KL reference policy (its weights in every rank and rollout
    worker, its recurrent state in every fragment)."""
    rollout_config, train_config = cfg.rollout_config, cfg.train_config
    rb = rollout_config.replay_buffer_config
    policy = meta_policy(policy_generator)
    parameters = sum(p.numel() for p in policy.parameters()) if policy is not None else 0
    policy_bytes = _tensor_bytes(dict(policy.state_dict())) if policy is not None else 0
    state_bytes = 0
    if policy is not None and hasattr(policy, "initial_state"):
        try:
            state_bytes = _tensor_bytes(policy.initial_state(1))
        except Exception:  # noqa: BLE001 - a state the meta device cannot build counts as none
            state_bytes = 0
    step_bytes = _space_bytes(observation_space) + _space_bytes(action_space) + STEP_COLUMNS_BYTES
    # Each fragment starts with the policy's recurrent state, and the KL reference's beside it (the reference
    # carries its own state through the same fragments).
    fragment_bytes = rollout_config.fragment_length * step_bytes + (2 if reference else 1) * state_bytes
    # Each env fills its next fragment in arrays of the whole length, allocated when it starts.
    builder_step = _space_bytes(observation_space) + _space_bytes(action_space) + BUILDER_COLUMNS_BYTES
    fragments = 0 if getattr(store_cls, "persistent", False) else rb.max_chunks * rb.fragments_per_chunk
    # A rank holds its iteration (micro-batches of batch_size_per_gpu chunks) and prefetch_batches more.
    rank_fragments = train_config.batches_per_iteration * train_config.batch_size_per_gpu * rb.fragments_per_chunk
    rank_batches = rank_fragments * (
        (1 + train_config.prefetch_batches) * fragment_bytes + rollout_config.fragment_length * ESTIMATE_COLUMNS_BYTES
    )
    envs = rollout_config.num_rollout_workers * rollout_config.worker_config.num_envs
    copies = int(reference)
    parts = {
        "trainer ranks": train_config.num_workers
        * (PROCESS_BYTES + (TRAINER_COPIES + copies) * policy_bytes + rank_batches),
        "rollout workers": rollout_config.num_rollout_workers
        * (PROCESS_BYTES + (ROLLOUT_COPIES + copies) * policy_bytes)
        + envs * rollout_config.fragment_length * builder_step,
        "replay (in memory)": fragments * fragment_bytes,
        "envs": envs * ENV_PROCESS_BYTES if rollout_config.worker_config.env_processes else 0,
        "driver, bookkeeping actors and Ray": (1 + BOOKKEEPING_ACTORS) * PROCESS_BYTES + RAY_BYTES + policy_bytes,
    }
    if train_config.eval_interval:  # the evaluation actor: its policy and its env, in its own process
        parts["evaluation"] = PROCESS_BYTES + policy_bytes + ENV_PROCESS_BYTES
    if cfg.policy_config is not None:
        from mineonline_core.config.secrets import redact

        policy_text = f"policy_config={redact(cfg.policy_config.model_dump())}"[:200]
    else:
        policy_text = "policy_generator()"
    # What the parts above add per step of fragment_length, to name it when it is what does not fit.
    per_step = (
        train_config.num_workers
        * rank_fragments
        * ((1 + train_config.prefetch_batches) * step_bytes + ESTIMATE_COLUMNS_BYTES)
        + envs * builder_step
        + fragments * step_bytes
    )
    from mineonline_core.driver.gpu_budget import estimate_gpu

    gpu = estimate_gpu(
        cfg,
        policy,
        policy_bytes=policy_bytes,
        state_bytes=state_bytes,
        step_bytes=step_bytes + ESTIMATE_COLUMNS_BYTES,
        observation_space=observation_space,
        reference=reference,
    )
    return MemoryEstimate(
        gpu=gpu,
        policy=policy,
        parameters=parameters,
        policy_bytes=policy_bytes,
        parts=parts,
        policy_text=policy_text,
        fragment_length=rollout_config.fragment_length,
        step_bytes=per_step,
        env_fragment_bytes=rollout_config.fragment_length * builder_step,
    )
