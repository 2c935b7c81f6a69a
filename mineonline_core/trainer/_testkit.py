"""Small real pieces for trainer tests: envs with dict observations, the core's real policies, and a
step-by-step rollout loop producing fragments with every ``mineonline_core.fragment`` column.

The loop mirrors what a rollout worker does (one policy step at a time, state reset at ``first``,
behaviour log-prob and denormalised value stored per step), so comparing the trainer's sequence
forward against it checks DESIGN §5.3 without Ray.
"""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np
import torch

from mineonline_core import fragment as F
from mineonline_core.envs import DictObservation
from mineonline_core.models import MLPPolicy, RecurrentCNNPolicy
from mineonline_core.tree import tree_index, tree_map, tree_stack


def cartpole(max_steps: int = 12) -> gym.Env:
    """CartPole with a short time limit, so fragments hold both terminations and truncations."""
    return DictObservation(gym.wrappers.TimeLimit(gym.make("CartPole-v1").unwrapped, max_episode_steps=max_steps))


class TinyImageEnv(gym.Env):
    """64x64 RGB noise; episodes end at random, half by termination, half by a time limit."""

    def __init__(self, seed: int = 0, mean_length: int = 6) -> None:
        self.observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
        self.action_space = gym.spaces.Discrete(3)
        self.rng = np.random.default_rng(seed)
        self.p_end = 1.0 / mean_length

    def _obs(self) -> dict:
        return {"image": self.rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        end = self.rng.random() < self.p_end
        term = end and self.rng.random() < 0.5
        return self._obs(), float(action) - 1.0, term, end and not term, {}


def mlp_policy(seed: int = 0, hidden: int = 32) -> MLPPolicy:
    torch.manual_seed(seed)
    return MLPPolicy(obs_dim=4, num_actions=2, hidden_sizes=[hidden, hidden])


def cnn_policy(seed: int = 0) -> RecurrentCNNPolicy:
    torch.manual_seed(seed)
    return RecurrentCNNPolicy(image_shape=(64, 64, 3), num_actions=3, channels=[8, 16, 16], hidden_size=32)


def _value(policy: torch.nn.Module, latents: dict) -> torch.Tensor:
    v = latents["vpred"]
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
) -> dict[str, list[dict]]:
    """Step ``num_envs`` envs (``env_fn(i)``) one step at a time; return fragments per stream, in order."""
    envs = [env_fn(i) for i in range(num_envs)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    first = np.ones(num_envs, dtype=bool)
    state = policy.initial_state(num_envs)
    episode = np.zeros(num_envs, dtype=np.int64)
    streams: dict[str, list[dict]] = {f"0.0.{i}": [] for i in range(num_envs)}
    for index in range(fragments_per_env):
        state_before = state
        cols: dict[str, list] = {c: [] for c in F.STEP_COLUMNS}
        for _ in range(fragment_length):
            latents, state = policy(input=_batch_obs(obs), state_in=state, context={"first": torch.as_tensor(first)[:, None]})
            logits = latents["pi_logits"][:, 0]
            action = policy.pi_head.sample(logits)
            logprob = policy.pi_head.logprob(action, logits)
            vpred = _value(policy, latents)[:, 0]
            rewards, terms, truncs, boots, next_obs = [], [], [], [], []
            for i, env in enumerate(envs):
                o, r, term, trunc, _ = env.step(int(action[i]))
                boot = 0.0
                if trunc and not term:
                    # The value of the observation the episode was cut at, from the state after this step.
                    lat, _ = policy(input=_batch_obs([o]), state_in=tree_map(lambda x: x[i : i + 1], state),
                                    context={"first": torch.zeros(1, 1, dtype=torch.bool)})  # fmt: skip
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
            frag.update({F.STREAM: f"0.0.{i}", F.INDEX: index, F.WORKER_ID: 0, F.ENV_ID: i})
            streams[f"0.0.{i}"].append(frag)
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
    from mineonline_core.plugins import import_string

    cls = import_string(config["trainer_cls"])
    trainer = cls(rollout_manager=None, policy_generator=mlp_policy, env_generator=None,
                  config=OnlineConfig(**config["online"]), run_dir=config["run_dir"])  # fmt: skip
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
