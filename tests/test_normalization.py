"""``train_config.normalize_observations`` and ``normalize_rewards`` (mineonline_core/contracts/normalize.py).

The statistics are checked against plainly written numpy references; the trainer, a checkpoint and its
resume, the rollout worker's policy, the evaluator and ``load_policy(...).predict`` are the real ones
(the trainer set up as one local rank, without Ray; one test reads chunks from a real ReplayBuffer actor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.normalize import FIRST_SERVING, RAW_REWARD, RunningMeanStd, scale_rewards
from mineonline_core.driver import api
from mineonline_core.driver.evaluate import load_policy
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.batch import assemble_chunks

pytest_plugins = ["mineonline_core.testing.fixtures"]

CARTPOLE = {
    "env_config": {"name": "gymnasium", "id": "CartPole-v1", "max_episode_steps": 30},
    "policy_config": {"name": "mlp", "hidden_sizes": [16, 16]},
    "logger_config": {"loggers": []},
    "rollout_config": {"fragment_length": 8, "replay_buffer_config": {"database_config": {"backend": "memory"}}},
    "train_config": {
        "num_iterations": 5,
        "batch_size_per_gpu": 2,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "context_length": 8,
        "learning_rate": 1e-3,
        "discount": 0.9,
        "normalize_observations": True,
        "normalize_rewards": True,
        "eval_episodes": 2,
    },
}


def _trainer(tmp_path: Path, *overrides: str) -> Any:
    resolved = resolve(
        load_config(CARTPOLE, ["run_name=norm", f"output_dir={tmp_path}", *overrides]), get_plugin_manager()
    )
    api._prepare_run_dir(resolved)
    trainer = api._trainer(resolved, manager=None, hub=None)
    trainer.setup_rank(local=True)
    return trainer, resolved


def _batch(trainer: Any, *, fresh: list[bool]) -> dict[str, Any]:
    """Real CartPole fragments from the trainer's policy, one chunk per stream, through ``estimate``."""
    streams = tk.rollout_fragments(
        trainer.policy, lambda i: tk.cartpole(12), num_envs=len(fresh), fragment_length=8, fragments_per_env=1
    )
    batch = assemble_chunks(tk.chunks_of(streams, 1))
    batch[FIRST_SERVING] = torch.tensor(fresh)
    batch[F.STALENESS] = torch.zeros_like(batch[F.REWARD])
    return trainer.algorithm.estimate(batch=batch)


def _set_stats(norm: RunningMeanStd, mean: Any, var: Any, count: float) -> None:
    with torch.no_grad():
        norm.mean.copy_(torch.as_tensor(mean, dtype=torch.float64))
        norm.var.copy_(torch.as_tensor(var, dtype=torch.float64))
        norm.count.fill_(count)


# -- the running statistics --------------------------------------------------------------------------------


def test_running_mean_and_variance_equal_numpy_over_batches_and_ranks() -> None:
    rng = np.random.default_rng(0)
    # Sizes, means and scales differ batch to batch and feature to feature: every term of the merge counts.
    batches = [
        shift + rng.normal([5.0, -3.0, 0.0], [0.1, 4.0, 1.0], size=(n, 3))
        for n, shift in ((1, 0.0), (7, 10.0), (300, -2.0), (2, 50.0))
    ]
    sequential = RunningMeanStd((3,))
    for b in batches:
        sequential.update(torch.as_tensor(b))
    everything = np.concatenate(batches)
    np.testing.assert_allclose(sequential.mean.numpy(), everything.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sequential.var.numpy(), everything.var(0), rtol=1e-10)
    assert float(sequential.count) == len(everything)

    # Three ranks each update with their own batch and a gather of every rank's moments: all end equal.
    rows = [RunningMeanStd((3,)).moments(torch.as_tensor(b)) for b in batches[:3]]
    ranks = [RunningMeanStd((3,)) for _ in range(3)]
    for rank, b in zip(ranks, batches[:3]):
        rank.update(torch.as_tensor(b), gather=lambda own: torch.cat(rows))
    three = np.concatenate(batches[:3])
    for rank in ranks:
        np.testing.assert_allclose(rank.mean.numpy(), three.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(rank.var.numpy(), three.var(0), rtol=1e-10)
        assert float(rank.count) == len(three)


def _rank_updates(rank: int, world: int, init_file: str, batches: list[np.ndarray], out: str) -> None:
    """One gloo rank: its own batch through the trainer's real all-gather (``UpdateLoop.all_gather``)."""
    import torch.distributed as dist

    from mineonline_core.trainer.update import UpdateLoop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    loop = UpdateLoop()
    loop.world_size = world
    norm = RunningMeanStd((3,))
    norm.update(torch.as_tensor(batches[rank]), gather=loop.all_gather)
    torch.save(norm.state_dict(), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_two_ranks_end_with_the_statistics_of_both_batches(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    batches = [rng.normal(0.0, 1.0, (5, 3)), rng.normal(4.0, 3.0, (11, 3))]
    # Forked: a spawned child could not import this test module by name.
    torch.multiprocessing.start_processes(
        _rank_updates, args=(2, str(tmp_path / "init"), batches, str(tmp_path)), nprocs=2, start_method="fork"
    )
    both = np.concatenate(batches)
    for rank in range(2):
        state = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert float(state["count"]) == len(both)
        np.testing.assert_allclose(state["mean"].numpy(), both.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(state["var"].numpy(), both.var(0), rtol=1e-10)


def test_observations_are_normalised_and_clipped_inside_the_policy(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path)
    policy = trainer.policy
    _set_stats(policy.obs_normalizer, [1.0, -2.0, 0.5, 3.0], [4.0, 0.25, 1.0, 9.0], 100)
    raw = torch.tensor([[[3.0, -2.5, 0.5, 3.0]], [[1.0, 40.0, -60.0, 3.0]]])  # the second row beyond +-10
    expected = ((raw.double() - policy.obs_normalizer.mean) / (policy.obs_normalizer.var + 1e-8).sqrt()).clamp(-10, 10)
    assert expected[1, 0, 1] == 10 and expected[1, 0, 2] == -10
    plain = type(policy).build(  # the same policy without the normaliser, given the normalised input
        type(policy).Config(hidden_sizes=[16, 16]),
        observation_space=gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)}),
        action_space=gym.spaces.Discrete(2),
    )
    plain.load_state_dict({k: v for k, v in policy.state_dict().items() if not k.startswith(("obs_", "reward_"))})
    first = torch.ones(2, 1, dtype=torch.bool)
    with torch.no_grad():
        got, _ = policy(input={"obs": raw}, state_in=None, context={"first": first})
        want, _ = plain(input={"obs": expected.float()}, state_in=None, context={"first": first})
    torch.testing.assert_close(got["pi_logits"], want["pi_logits"])
    torch.testing.assert_close(got["vpred"], want["vpred"])


def test_an_env_without_an_obs_array_is_refused_before_ray() -> None:
    config = {
        **CARTPOLE,
        "env_config": {"name": "crafter", "length": 20},
        "policy_config": {"name": "cnn", "channels": [4, 8, 8], "hidden_size": 16},
    }
    with pytest.raises(ConfigError) as err:
        resolve(load_config(config), get_plugin_manager())
    message = str(err.value)
    assert "train_config.normalize_observations: true" in message and "image" in message
    assert "Fix: set train_config.normalize_observations: false" in message
    assert "\n" not in message.strip()  # one paragraph


# -- rewards -----------------------------------------------------------------------------------------------


def _plain_reward_scaling(batches: list[dict], discount: float) -> list[np.ndarray]:
    """VecNormalize's reward scaling written out: the discounted return restarts at every episode start and at
    each chunk's first step; the variance is over the returns of every first-served chunk so far."""
    seen: list[float] = []
    out = []
    for batch in batches:
        reward, first, fresh = batch["reward"], batch["first"], batch[FIRST_SERVING]
        for i in range(reward.shape[0]):
            running = 0.0
            for t in range(reward.shape[1]):
                running = reward[i, t] + (0.0 if first[i, t] or t == 0 else discount * running)
                if fresh[i]:
                    seen.append(running)
        std = np.sqrt(np.var(seen) + 1e-8)
        out.append(np.clip(reward / std, -10, 10))
    return out


def test_rewards_are_divided_by_the_std_of_the_discounted_return() -> None:
    rng = np.random.default_rng(1)
    batches = []
    for n, scale in ((3, 1.0), (2, 30.0), (4, 0.01)):
        reward = rng.normal(0.5, scale, (n, 12)).astype(np.float32)
        reward[1, 5] = 1e4  # in a chunk served again: it moves no statistic, and scaled it is clipped
        first = rng.random((n, 12)) < 0.15
        fresh = np.arange(n) % 2 == 0  # the others are served again (max_reuse): they must not count
        batches.append({"reward": reward, "first": first, FIRST_SERVING: fresh})
    expected = _plain_reward_scaling(batches, discount=0.9)
    policy = torch.nn.Module()
    policy.reward_normalizer = RunningMeanStd(())
    for batch, want in zip(batches, expected):
        tensors = {k: torch.as_tensor(v) for k, v in batch.items()}
        got = scale_rewards(policy, tensors, discount=0.9)
        np.testing.assert_allclose(got["reward"].numpy(), want, rtol=1e-5)
        np.testing.assert_array_equal(got[RAW_REWARD].numpy(), batch["reward"])  # raw kept beside
    assert all(np.abs(want).max() == 10.0 for want in expected)


# -- the trainer, checkpoints, workers, evaluation and load_policy ------------------------------------------


def test_the_trainer_moves_the_statistics_once_per_sample_after_its_update(tmp_path: Path) -> None:
    trainer, _ = _trainer(tmp_path)
    norm = trainer.policy.obs_normalizer
    batch = _batch(trainer, fresh=[True, False, True, False])
    assert float(norm.count) == 0  # the estimate only applies them
    metrics = trainer.train(batch)
    fresh_obs = batch[F.OBS]["obs"][[0, 2]].reshape(-1, 4).double().numpy()
    assert float(norm.count) == len(fresh_obs) == metrics["normalize/obs_count"]
    np.testing.assert_allclose(norm.mean.numpy(), fresh_obs.mean(0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(norm.var.numpy(), fresh_obs.var(0), rtol=1e-8)


def _trained(tmp_path: Path) -> tuple[Any, Any]:
    """A trainer whose statistics moved far from the identity, and weights unlike a fresh policy's."""
    trainer, resolved = _trainer(tmp_path)
    _set_stats(trainer.policy.obs_normalizer, [0.3, -1.0, 0.05, 2.0], [0.01, 4.0, 0.0004, 0.25], 512)
    _set_stats(trainer.policy.reward_normalizer, 0.0, 6.25, 512)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.5 * torch.randn_like(p))
    trainer.iteration, trainer.version = 2, 2
    return trainer, resolved


def _stats(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.clone() for k, v in policy.state_dict().items() if k.startswith(("obs_normalizer", "reward_normalizer"))
    }


def test_statistics_survive_a_checkpoint_and_a_resume(tmp_path: Path) -> None:
    trainer, _ = _trained(tmp_path)
    saved = _stats(trainer.policy)
    assert set(saved) == {f"{m}.{b}" for m in ("obs_normalizer", "reward_normalizer") for b in ("mean", "var", "count")}
    path = trainer.save_checkpoint()
    resumed, _ = _trainer(tmp_path, "run_name=norm2", f"train_config.resume={path}")
    assert resumed.iteration == 2
    restored = _stats(resumed.policy)
    for key, value in saved.items():
        assert torch.equal(restored[key], value), key


def _raw_observations() -> np.ndarray:
    rng = np.random.default_rng(3)
    return (np.array([0.3, -1.0, 0.05, 2.0]) + rng.normal(0, 1, (64, 4)) * [0.1, 2.0, 0.02, 0.5]).astype(np.float32)


def test_worker_evaluator_and_load_policy_act_as_the_trainer(tmp_path: Path) -> None:
    from mineonline_core.config.precision import PrecisionChoice
    from mineonline_core.rollout.localpolicy import LocalPolicy
    from mineonline_core.services.evaluator import Evaluator

    trainer, resolved = _trained(tmp_path)
    checkpoint = trainer.save_checkpoint()
    raw = _raw_observations()
    obs = {"obs": torch.as_tensor(raw)[:, None]}
    first = torch.ones(len(raw), 1, dtype=torch.bool)
    weights = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}

    def greedy(policy: torch.nn.Module) -> np.ndarray:
        with torch.no_grad():
            latents, _ = policy(input=obs, state_in=None, context={"first": first})
        return latents["pi_logits"][:, 0].argmax(-1).numpy()

    want = greedy(trainer.policy)
    assert 0 < want.sum() < len(want)  # both actions occur: a skipped normalisation would show

    # A rollout worker's policy: built by the run's generator, weights loaded through its receiver.
    worker = LocalPolicy(
        policy=resolved.policy_generator(),
        device=torch.device("cpu"),
        precision=PrecisionChoice.from_config(resolved.config.train_config).on(torch.device("cpu")),
    )
    worker.set_weights(weights, version=2)
    worker.swap()
    np.testing.assert_array_equal(greedy(worker.policy), want)

    evaluator = Evaluator(
        policy_generator=resolved.policy_generator, env_generator=resolved.env_generator, config=resolved.config
    )
    evaluator.evaluate(weights, iteration=2, version=2, env_steps=0)
    np.testing.assert_array_equal(evaluator.policy.predict(raw, deterministic=True)[0], want)

    loaded = load_policy(checkpoint)
    np.testing.assert_array_equal(loaded.predict(raw, deterministic=True)[0], want)
    np.testing.assert_array_equal(load_policy(tmp_path / "norm").predict(raw, deterministic=True)[0], want)


def test_only_a_chunks_first_serving_counts_through_the_real_replay_buffer(local_ray: Any, tmp_path: Path) -> None:
    from mineonline_core.contracts.fragment import fragment_meta
    from mineonline_core.contracts.store import MemoryStore
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host

    trainer, _ = _trainer(tmp_path, "train_config.normalize_observations=false", "train_config.prefetch_batches=0")
    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        local_ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=16, max_reuse=2, max_staleness=100)
    )
    (frag,) = tk.rollout_fragments(
        trainer.policy, lambda i: tk.cartpole(50), num_envs=1, fragment_length=8, fragments_per_env=1
    )["0.0.0"]
    frag[F.REWARD] = np.arange(1, 9, dtype=np.float32)  # a return that grows: its variance is not 0
    frag.update({F.STREAM: "a", F.INDEX: 0})
    meta = fragment_meta(frag)
    store.put(meta["key"], frag)
    local_ray.get(buffer.add_fragment.remote(meta))
    trainer._buffer, trainer._store = buffer, store
    norm = trainer.policy.reward_normalizer
    seen = []
    for iteration in (1, 2):  # the same chunk both times (max_reuse 2)
        trainer.iteration = iteration
        batch = trainer.fetch_fragments_and_estimate_advantages(1)
        seen.append((batch[FIRST_SERVING].tolist(), float(norm.count)))
    assert seen == [([True], 8.0), ([False], 8.0)]
    returns, running = [], 0.0
    for t in range(8):  # the chunk's discounted return, restarted where an episode starts
        running = float(frag[F.REWARD][t]) + (0.0 if t == 0 or frag[F.FIRST][t] else 0.9 * running)
        returns.append(running)
    np.testing.assert_allclose(float(norm.var), np.var(returns), rtol=1e-10)
    np.testing.assert_allclose(batch[F.REWARD].numpy()[0], frag[F.REWARD] / np.sqrt(np.var(returns) + 1e-8), rtol=1e-6)
