"""Small real pieces for tests, benchmarks and plugin authors: envs, tiny policies and a rollout loop.

* envs (from the torch-free ``mineonline_core.testing.envs``, which env processes import): ``CountingEnv``,
  ``TinyImageEnv``, ``cartpole`` and the module-level factories ``counting``, ``time_limited_counting``,
  ``counting_failing_reset`` and ``faulty_counting``;
* policies honouring the policy contract: ``TinyMLPPolicy``, ``TinyGRUPolicy``, and the core's own
  networks at test size (``mlp_policy``, ``cnn_policy``);
* ``rollout_fragments``: a step-by-step rollout loop producing fragments with every
  ``mineonline_core.contracts.fragment`` column, as a rollout worker would (one policy step at a time, state
  reset at ``first``, behaviour log-prob and denormalised value stored per step), so the trainer's
  sequence forward can be checked against it without Ray; ``chunks_of`` and ``ddp_train_step``.

They live in the package (not under ``tests/``) because env factories are unpickled in env
subprocesses and policies in Ray workers, which must be able to import them; a top-level ``tests``
package installed by a dependency (opensimplex ships one) would shadow ours there.
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from mineonline_core.builtin.models import MLPPolicy, RecurrentCNNPolicy
from mineonline_core.config.rollout import RolloutConfig, WorkerConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.policy import CategoricalHead, Policy, ValueHead
from mineonline_core.contracts.tree import tree_index, tree_map, tree_stack
from mineonline_core.testing.envs import (  # noqa: F401 - the kit's envs, importable from here as before
    CountingEnv,
    TinyImageEnv,
    cartpole,
    counting,
    counting_failing_reset,
    faulty_counting,
    time_limited_counting,
)


def rollout_config(**keys: Any) -> RolloutConfig:
    """A validated ``rollout_config`` from flat keys, for building a collector or worker directly:
    ``worker_config``'s keys (``batch_size``, ``env_processes``, ...) go into that section."""
    worker = {k: keys.pop(k) for k in list(keys) if k in WorkerConfig.model_fields}
    return RolloutConfig(**keys, worker_config=WorkerConfig(**worker))


def collector(*, policy: torch.nn.Module, env_fns: list[Callable[[], Any]], **keys: Any) -> Any:
    """A ``FragmentCollector`` from flat keys: those of ``rollout_config`` and ``worker_config`` form
    its config (``num_envs`` follows ``env_fns``), the rest (``seed``, ``backoff_base``, ...) go to it."""
    from mineonline_core.rollout.collector import FragmentCollector

    fields = set(RolloutConfig.model_fields) | set(WorkerConfig.model_fields)
    config = rollout_config(num_envs=len(env_fns), **{k: keys.pop(k) for k in list(keys) if k in fields})
    return FragmentCollector(policy=policy, env_fns=env_fns, config=config, **keys)


# ---------------------------------------------------------------------------------------------
# Tiny policies honouring the policy contract
# ---------------------------------------------------------------------------------------------


class TinyMLPPolicy(Policy):
    """Feed-forward: ``{"obs": (B,T,D)}`` → categorical logits and a value."""

    name = "tiny_mlp"

    def __init__(self, obs_dim: int = 3, n_actions: int = 2, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh())
        self.pi_head = CategoricalHead(hidden, n_actions)
        self.value_head = ValueHead(hidden, normalize=False)

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = self.body(input["obs"].to(self.body[0].weight.dtype))  # float32, or float64 after .double()
        return {Outputs.PI_LOGITS: self.pi_head(x), Outputs.VPRED: self.value_head(x)}, None


class TinyGRUPolicy(Policy):
    """Recurrent: a GRU cell with state (B, H), reset to zeros wherever ``first`` is set."""

    name = "tiny_gru"

    def __init__(self, obs_dim: int = 3, n_actions: int = 2, hidden: int = 8) -> None:
        super().__init__()
        self.hidden = hidden
        self.inp = nn.Linear(obs_dim, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.pi_head = CategoricalHead(hidden, n_actions)
        self.value_head = ValueHead(hidden, normalize=False)

    def initial_state(self, batch_size: int) -> list[torch.Tensor]:
        return [torch.zeros(batch_size, self.hidden, dtype=self.inp.weight.dtype)]

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = torch.tanh(self.inp(input["obs"].to(self.inp.weight.dtype)))
        h, first = state_in[0], context["first"]
        outs = []
        for t in range(x.shape[1]):
            h = torch.where(first[:, t, None], torch.zeros_like(h), h)
            h = self.cell(x[:, t], h)
            outs.append(h)
        y = torch.stack(outs, 1)
        return {Outputs.PI_LOGITS: self.pi_head(y), Outputs.VPRED: self.value_head(y)}, [h]


# ---------------------------------------------------------------------------------------------
# The core's networks at test size, and a rollout loop without Ray
# ---------------------------------------------------------------------------------------------


def mlp_policy(seed: int = 0, hidden: int = 32) -> MLPPolicy:
    torch.manual_seed(seed)
    return MLPPolicy(obs_dim=4, num_actions=2, hidden_sizes=[hidden, hidden])


def local_loop(
    algorithm: type,
    config: Any,
    *,
    run_dir: str,
    policy: Callable[[], nn.Module] = mlp_policy,
    env: Callable[[], Any] | None = None,
    device: torch.device | None = None,
) -> Any:
    """A ``TrainLoop`` around ``algorithm`` set up on one local rank (on ``device``, the CPU by default) with
    no rollout side, for tests that hand it batches themselves."""
    from mineonline_core.trainer.loop import TrainLoop

    loop = TrainLoop(
        algorithm=algorithm,
        rollout_manager=None,
        policy_generator=policy,
        env_generator=env,
        config=config,
        run_dir=run_dir,
    )
    loop.setup_rank(local=True, device=device)
    return loop


def cnn_policy(seed: int = 0) -> RecurrentCNNPolicy:
    torch.manual_seed(seed)
    return RecurrentCNNPolicy(image_shape=(64, 64, 3), num_actions=3, channels=[8, 16, 16], hidden_size=32)


def _value(policy: torch.nn.Module, latents: dict) -> torch.Tensor:
    v = latents[Outputs.VPRED]
    v = v[..., 0] if v.dim() == 3 else v
    return policy.value_head.denormalize(v)


def _batch_obs(obs: list[dict]) -> dict:
    return {k: torch.as_tensor(np.stack([o[k] for o in obs]))[:, None] for k in obs[0]}


@torch.no_grad()
def rollout_fragments(
    policy: torch.nn.Module,
    env_fn: Callable[[int], gym.Env],
    *,
    num_envs: int = 2,
    fragment_length: int = 8,
    fragments_per_env: int = 4,
    version: int = 0,
    seed: int = 0,
    reference: torch.nn.Module | None = None,
) -> dict[str, list[dict]]:
    """Step ``num_envs`` envs (``env_fn(i)``) one step at a time; return fragments per stream, in order. With a KL
    ``reference``, it runs beside the policy with its own state, recorded as ``ref_state_in`` and ``ref_logits``."""
    envs = [env_fn(i) for i in range(num_envs)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    first = np.ones(num_envs, dtype=bool)
    state = policy.initial_state(num_envs)
    ref_state = reference.initial_state(num_envs) if reference is not None else None
    episode = np.zeros(num_envs, dtype=np.int64)
    streams: dict[str, list[dict]] = {F.stream_name(0, 0, i): [] for i in range(num_envs)}
    for index in range(fragments_per_env):
        state_before, ref_before = state, ref_state
        cols: dict[str, list] = {c: [] for c in (*F.STEP_COLUMNS, F.REF_LOGITS)}
        for _ in range(fragment_length):
            if reference is not None:
                ref_latents, ref_state = reference(
                    input=_batch_obs(obs), state_in=ref_state, context={"first": torch.as_tensor(first)[:, None]}
                )
                cols[F.REF_LOGITS].append(tree_map(lambda x: x[:, 0].float().numpy(), ref_latents[Outputs.PI_LOGITS]))
            latents, state = policy(
                input=_batch_obs(obs), state_in=state, context={"first": torch.as_tensor(first)[:, None]}
            )
            logits = latents[Outputs.PI_LOGITS][:, 0]
            action = policy.pi_head.sample(logits)
            logprob = policy.pi_head.logprob(action, logits)
            vpred = _value(policy, latents)[:, 0]
            rewards, terms, truncs, boots, next_obs = [], [], [], [], []
            for i, env in enumerate(envs):
                o, r, term, trunc, _ = env.step(int(action[i]))
                boot = 0.0
                if trunc and not term:
                    # The value of the observation the episode was cut at, from the state after this step.
                    lat, _ = policy(
                        input=_batch_obs([o]),
                        state_in=tree_map(lambda x: x[i : i + 1], state),
                        context={"first": torch.zeros(1, 1, dtype=torch.bool)},
                    )
                    boot = float(_value(policy, lat)[0, 0])
                if term or trunc:
                    o, _ = env.reset()
                rewards.append(r), terms.append(term), truncs.append(trunc and not term), boots.append(boot)
                next_obs.append(o)
            cols[F.OBS].append({k: np.stack([o[k] for o in obs]) for k in obs[0]})
            cols[F.ACTION].append(action.numpy())
            cols[F.REWARD].append(np.float32(rewards))
            cols[F.TERMINATED].append(np.array(terms))
            cols[F.TRUNCATED].append(np.array(truncs))
            cols[F.FIRST].append(first.copy())
            cols[F.LOGPROB].append(logprob.numpy())
            cols[F.VPRED].append(vpred.numpy())
            cols[F.BOOTSTRAP].append(np.float32(boots))
            cols[F.EPISODE_ID].append(episode.copy())
            cols[F.VERSION].append(np.full(num_envs, version, dtype=np.int64))
            done = np.array(terms) | np.array(truncs)
            episode, first, obs = episode + done, done, next_obs
        stacked = {c: tree_stack(cols[c], axis=1) for c in F.STEP_COLUMNS}  # (num_envs, T, ...)
        for i in range(num_envs):
            frag = {c: tree_index(stacked[c], i) for c in F.STEP_COLUMNS}
            frag[F.NEXT_OBS] = {k: v[None] for k, v in obs[i].items()}
            frag[F.STATE_IN] = tree_map(lambda x: x[i : i + 1].numpy().copy(), state_before)
            if reference is not None:
                frag[F.REF_STATE_IN] = tree_map(lambda x: x[i : i + 1].numpy().copy(), ref_before)
                frag[F.REF_LOGITS] = tree_map(lambda x: x[i].copy(), tree_stack(cols[F.REF_LOGITS], axis=1))
            frag.update({F.STREAM: F.stream_name(0, 0, i), F.INDEX: index, F.WORKER_ID: 0, F.ENV_ID: i})
            streams[F.stream_name(0, 0, i)].append(frag)
    for env in envs:
        env.close()
    return streams


def chunks_of(streams: dict[str, list[dict]], fragments_per_chunk: int) -> list[list[dict]]:
    """Cut each stream into consecutive chunks of ``fragments_per_chunk`` fragments."""
    out = []
    for frags in streams.values():
        for start in range(0, len(frags) - fragments_per_chunk + 1, fragments_per_chunk):
            out.append(frags[start : start + fragments_per_chunk])
    return out


def ddp_train_step(config: dict) -> None:
    """A Ray Train loop for the DDP test: one ``train`` call on this rank's share of a saved batch.

    ``config``: ``trainer_cls`` (import path), ``online`` (an OnlineConfig dict), ``batch_path``,
    ``out_path``, ``run_dir``. Micro-batch k of rank r holds the r-th share of the single-rank run's
    micro-batch k, so both runs see the same global micro-batches; rank 0 saves the parameters.
    """
    import ray.train

    from mineonline_core.config import OnlineConfig
    from mineonline_core.config.generators import import_generator
    from mineonline_core.trainer.base import build_loop

    cls = import_generator(config["trainer_cls"], key="trainer_cls")
    trainer = build_loop(
        cls,
        rollout_manager=None,
        policy_generator=mlp_policy,
        env_generator=None,
        config=OnlineConfig(**config["online"]),
        run_dir=config["run_dir"],
    )
    trainer.setup_rank(local=config.get("local", False))
    batch = torch.load(config["batch_path"], weights_only=True)
    n, world, rank = batch[F.REWARD].shape[0], trainer.world_size, trainer.rank
    per = trainer.train_config.batch_size_per_gpu
    rows = torch.tensor([k * per * world + rank * per + j for k in range(n // (per * world)) for j in range(per)])
    trainer.iteration = 1
    metrics = trainer.train(tree_map(lambda x: x[rows], batch))
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in trainer.policy.state_dict().items()}, config["out_path"])
    if not config.get("local", False):
        ray.train.report(metrics)


def ddp_run(loop: Callable[[dict], None], config: dict, *, run_dir: str, tag: str, num_workers: int = 2) -> dict:
    """``loop(config)`` on ``num_workers`` Ray Train ranks (gloo, half a CPU each); returns the
    reported metrics. Ray must be initialised."""
    from pathlib import Path

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return (
        TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": 0.5}),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path=str(Path(run_dir) / "ray_train"), name=tag),
        )
        .fit()
        .metrics
    )


def ddp_fit(
    *, trainer_cls: str, online: dict, batch_path: str, run_dir: str, tag: str, num_workers: int = 2
) -> tuple[dict, dict]:
    """``ddp_train_step`` on ``num_workers`` Ray Train ranks; returns rank 0's parameters and the
    reported metrics. Ray must be initialised."""
    from pathlib import Path

    out = Path(run_dir) / f"params_{tag}.pt"
    config = {
        "trainer_cls": trainer_cls,
        "online": online,
        "batch_path": batch_path,
        "out_path": str(out),
        "run_dir": run_dir,
    }
    metrics = ddp_run(ddp_train_step, config, run_dir=run_dir, tag=tag, num_workers=num_workers)
    return torch.load(out, weights_only=True), metrics
