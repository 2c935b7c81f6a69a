"""Continuous (``Box``) and ``MultiDiscrete`` actions for the built-in policies (issue 35).

The heads' log-prob, entropy and KL against ``torch.distributions``; the env gets a Gaussian sample clipped to
its bounds while the fragment keeps the sample (rollout, both env kinds, and ``predict``/evaluation); float
actions survive the in-memory and LMDB stores bit for bit; ``mlp`` passes the policy conformance suite on both
spaces; and real PPO runs on gymnasium's ``Pendulum-v1`` and on a MultiDiscrete env complete, the Pendulum run's
checkpoint predicting bounded actions for the raw env's observations."""

from __future__ import annotations

import json
import sys

import cloudpickle
import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import Categorical, Normal, kl_divergence

from mineonline_core.builtin.models import CNNPolicy, ImpalaResNetPolicy, MLPPolicy
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.policy import GaussianHead, MultiCategoricalHead
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.errors import ConfigError
from mineonline_core.services.episodes import LoadedPolicy, run_episode
from mineonline_core.testing import kit as tk
from mineonline_core.testing.policy_conformance import PolicyConformance
from mineonline_core.testing.store_conformance import assert_tree_equal

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its envs travel to env processes

OBS = gym.spaces.Dict({"obs": gym.spaces.Box(-2.0, 2.0, (4,), np.float32)})
BOX = gym.spaces.Box(np.array([-1.0, -2.0], np.float32), np.array([1.0, 0.5], np.float32))
NVEC = [3, 2, 4]


def mlp(action_space: gym.Space) -> MLPPolicy:
    return MLPPolicy.build(MLPPolicy.Config(hidden_sizes=[16, 16]), observation_space=OBS, action_space=action_space)


# -- the heads against an independent implementation ------------------------------------------------


def gaussian_logits(head: GaussianHead, seed: int) -> torch.Tensor:
    """Logits through the head's own forward, with a non-zero mean and a log-std unlike 0 in every dim."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.linear.bias.copy_(torch.randn(head.dim, generator=gen))
        head.log_std.copy_(torch.randn(head.dim, generator=gen) * 0.7)
    return head(torch.randn(2, 5, head.linear.in_features, generator=gen))


def normal(logits: torch.Tensor, dim: int) -> Normal:
    return Normal(logits[..., :dim], logits[..., dim:].exp())


def test_gaussian_head_log_prob_entropy_and_kl_are_those_of_a_diagonal_normal() -> None:
    torch.manual_seed(0)
    head = GaussianHead(6, 3)
    q, p = gaussian_logits(head, 1), gaussian_logits(head, 2)
    assert q.shape == (2, 5, 6)
    action = torch.randn(2, 5, 3) * 2
    torch.testing.assert_close(head.logprob(action, q), normal(q, 3).log_prob(action).sum(-1))
    torch.testing.assert_close(head.entropy(q), normal(q, 3).entropy().sum(-1))
    torch.testing.assert_close(head.kl_divergence(q, p), kl_divergence(normal(q, 3), normal(p, 3)).sum(-1))
    assert not torch.allclose(head.kl_divergence(q, p), head.kl_divergence(p, q))  # the order matters and is q||p


def test_gaussian_head_samples_from_its_mean_and_state_independent_std() -> None:
    torch.manual_seed(0)
    head = GaussianHead(6, 3)
    assert torch.equal(head.log_std.detach(), torch.zeros(3))  # unit std at the start (PPO's reference)
    logits = gaussian_logits(head, 3).detach()[:1, :1].expand(20000, 1, 6)
    samples = head.sample(logits)
    assert samples.shape == (20000, 1, 3) and samples.dtype == torch.float32
    mean, std = logits[0, 0, :3], logits[0, 0, 3:].exp()
    torch.testing.assert_close(samples.mean((0, 1)), mean, atol=0.05 * float(std.max()), rtol=0)
    torch.testing.assert_close(samples.std((0, 1)), std, atol=0, rtol=0.03)
    assert torch.equal(head.sample(logits, deterministic=True)[0, 0], mean)
    # The log-std is one parameter for every state, trained by the loss's gradient.
    head.logprob(samples, head(torch.randn(20000, 1, 6))).sum().backward()
    assert head.log_std.grad is not None and bool((head.log_std.grad != 0).all())


def test_multi_categorical_head_log_prob_entropy_and_kl_sum_one_categorical_per_dimension() -> None:
    torch.manual_seed(0)
    head = MultiCategoricalHead(6, NVEC)
    q, p = head(torch.randn(2, 5, 6) * 3), head(torch.randn(2, 5, 6) * 3)
    assert q.shape == (2, 5, sum(NVEC))
    action = torch.stack([torch.randint(0, n, (2, 5)) for n in NVEC], -1)

    def dims(logits: torch.Tensor) -> list[Categorical]:
        return [Categorical(logits=part) for part in logits.split(NVEC, -1)]

    want_logprob = sum(d.log_prob(action[..., i]) for i, d in enumerate(dims(q)))
    torch.testing.assert_close(head.logprob(action, q), want_logprob)
    torch.testing.assert_close(head.entropy(q), sum(d.entropy() for d in dims(q)))
    torch.testing.assert_close(head.kl_divergence(q, p), sum(kl_divergence(a, b) for a, b in zip(dims(q), dims(p))))


def test_multi_categorical_head_samples_each_dimension_from_its_own_categorical() -> None:
    torch.manual_seed(0)
    head = MultiCategoricalHead(6, NVEC)
    logits = head(torch.randn(1, 1, 6) * 3).expand(20000, 1, sum(NVEC))
    samples = head.sample(logits)
    assert samples.shape == (20000, 1, 3) and samples.dtype == torch.int64
    for i, (part, n) in enumerate(zip(logits[0, 0].split(NVEC), NVEC)):
        freq = torch.bincount(samples[:, 0, i], minlength=n).float() / len(samples)
        torch.testing.assert_close(freq, part.exp(), atol=0.015, rtol=0)
        assert int(head.sample(logits, deterministic=True)[0, 0, i]) == int(part.argmax())


def test_ppo_loss_on_gaussian_logits_is_the_clipped_objective_written_with_torch_distributions() -> None:
    from mineonline_ppo import ppo_loss

    torch.manual_seed(0)
    head = GaussianHead(6, 3)
    logits = gaussian_logits(head, 4)
    old = logits.detach() + torch.cat([0.3 * torch.randn(2, 5, 3), torch.zeros(2, 5, 3)], -1)  # ratios far from 1
    ref = gaussian_logits(GaussianHead(6, 3), 5).detach()
    action = normal(old, 3).sample()
    behaviour = normal(old, 3).log_prob(action).sum(-1)
    advantage, vpred, target = torch.randn(2, 5), torch.randn(2, 5, requires_grad=True), torch.randn(2, 5)
    loss, stats = ppo_loss(
        pi_head=head,
        pi_logits=logits,
        vpred=vpred,
        action=action,
        behaviour_logprob=behaviour,
        proximal_logprob=behaviour,
        old_vpred=vpred.detach(),
        advantage=advantage,
        value_target=target,
        ref_logits=ref,
        rho=0.3,
        clip=0.2,
        behaviour_weight_clip=2.0,
        log_ratio_range=50.0,
        clip_vloss=False,
        policy_coef=1.0,
        vf_coef=0.5,
        entropy_coef=0.01,
    )
    ratio = (normal(logits, 3).log_prob(action).sum(-1) - behaviour).exp()
    policy_loss = -torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean()
    entropy = normal(logits, 3).entropy().sum(-1).mean()
    kl = kl_divergence(normal(logits, 3), normal(ref, 3)).sum(-1).mean()
    want = 0.5 * 0.5 * ((vpred - target) ** 2).mean() + policy_loss - 0.01 * entropy + 0.3 * kl
    assert float(stats["clipfrac"]) > 0  # some ratios are clipped, so the min/clip branch is exercised
    torch.testing.assert_close(loss, want)
    got = torch.autograd.grad(loss, [head.log_std, head.linear.weight], retain_graph=True)
    for g, w in zip(got, torch.autograd.grad(want, [head.log_std, head.linear.weight])):
        torch.testing.assert_close(g, w)


# -- which head each space gets ---------------------------------------------------------------------


def test_mlp_cnn_and_impala_choose_the_head_from_the_action_space() -> None:
    assert isinstance(mlp(BOX).pi_head, GaussianHead) and mlp(BOX).pi_head.dim == 2
    assert isinstance(mlp(gym.spaces.MultiDiscrete(NVEC)).pi_head, MultiCategoricalHead)
    image = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)})
    cnn = CNNPolicy.build(
        CNNPolicy.Config(channels=[4, 8, 8], hidden_size=16), observation_space=image, action_space=BOX
    )
    impala = ImpalaResNetPolicy.build(
        ImpalaResNetPolicy.Config(channels=[4], dense_sizes=[8]),
        observation_space=image,
        action_space=gym.spaces.MultiDiscrete(NVEC),
    )
    assert isinstance(cnn.pi_head, GaussianHead) and isinstance(impala.pi_head, MultiCategoricalHead)


@pytest.mark.parametrize(
    "space",
    [
        gym.spaces.Box(-1.0, 1.0, (2, 2), np.float32),
        gym.spaces.Box(0, 5, (2,), np.int64),
        gym.spaces.MultiDiscrete([3, 2], start=[1, 0]),
        gym.spaces.Tuple([gym.spaces.Discrete(2)]),
    ],
    ids=["box-2d", "box-int", "multidiscrete-start", "tuple"],
)
def test_an_action_space_without_a_head_is_refused_naming_the_key_the_space_and_the_fix(space: gym.Space) -> None:
    with pytest.raises(ConfigError) as info:
        mlp(space)
    message = str(info.value)
    assert "policy_config.name: 'mlp'" in message and str(space) in message and "Fix:" in message


# -- the conformance suite on both spaces -------------------------------------------------------------


class TestMLPBoxPolicy(PolicyConformance):
    observation_space = OBS
    action_space = BOX

    def make_policy(self) -> MLPPolicy:
        return mlp(self.action_space)


class TestMLPMultiDiscretePolicy(PolicyConformance):
    observation_space = OBS
    action_space = gym.spaces.MultiDiscrete(NVEC)

    def make_policy(self) -> MLPPolicy:
        return mlp(self.action_space)


# -- bounds: the env gets the clipped action, the fragment the sampled one ------------------------------


class EchoBoxEnv(gym.Env):
    """Observes the last action it received, so a fragment shows what the env was sent."""

    def __init__(self, episode_len: int = 5) -> None:
        self.observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})
        self.action_space = BOX
        self.episode_len, self.t = episode_len, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return {"obs": np.zeros(2, np.float32)}, {}

    def step(self, action):
        assert isinstance(action, np.ndarray) and action.dtype == np.float32 and action.shape == (2,), repr(action)
        self.t += 1
        return {"obs": np.array(action, np.float32)}, 0.0, self.t >= self.episode_len, False, {}


def wide_policy() -> MLPPolicy:
    """An mlp whose samples mostly leave BOX: mean (3, -3), std e^1."""
    torch.manual_seed(0)
    policy = MLPPolicy(obs_dim=2, hidden_sizes=[8], action_space=BOX)
    with torch.no_grad():
        policy.pi_head.linear.bias.copy_(torch.tensor([3.0, -3.0]))
        policy.pi_head.log_std.fill_(1.0)
    return policy


@pytest.mark.parametrize("env_processes", [True, False], ids=["processes", "inline"])
def test_rollout_sends_the_clipped_action_and_stores_the_sampled_one(env_processes: bool) -> None:
    policy = wide_policy()
    collector = tk.collector(
        policy=policy, env_fns=[EchoBoxEnv, EchoBoxEnv], fragment_length=8, batch_size=2, env_processes=env_processes
    )
    try:
        collector.warmup(timeout=120)
        frags = collector.collect(4)
    finally:
        collector.close()
    outside = 0
    for frag in frags:
        action, obs, first = frag[F.ACTION], frag[F.OBS]["obs"], frag[F.FIRST]
        assert action.dtype == np.float32 and action.shape == (8, 2)
        # Each step's observation echoes what the env received one step before (within an episode).
        for t in range(1, 8):
            if not first[t]:
                assert np.array_equal(obs[t], np.clip(action[t - 1], BOX.low, BOX.high)), (t, action[t - 1], obs[t])
        outside += int(((action < BOX.low) | (action > BOX.high)).any(-1).sum())
        # The behaviour log-prob is the sampled action's, which training recomputes.
        with torch.no_grad():
            latents, _ = policy({"obs": torch.as_tensor(obs)[None]}, None, {"first": torch.as_tensor(first)[None]})
            want = policy.pi_head.logprob(torch.as_tensor(action)[None], latents["pi_logits"])[0]
        np.testing.assert_allclose(frag[F.LOGPROB], want.numpy(), rtol=1e-5, atol=1e-5)
    assert outside > len(frags) * 4  # most samples left the bounds: the stored ones are not clipped


def test_predict_and_evaluation_episodes_send_the_clipped_action() -> None:
    policy = wide_policy().eval()
    loaded = LoadedPolicy(policy=policy, config=None, checkpoint=None, iteration=0, version=0, env_generator=EchoBoxEnv)
    torch.manual_seed(1)
    actions, _ = loaded.predict(np.zeros((64, 2), np.float32))
    assert actions.shape == (64, 2) and actions.dtype == np.float32
    assert BOX.contains(actions[0]) and bool(((actions >= BOX.low) & (actions <= BOX.high)).all())
    assert bool((actions == BOX.high)[:, 0].any())  # samples beyond the bound arrive at the bound
    env = EchoBoxEnv(episode_len=30)
    seen = []
    step = env.step
    env.step = lambda action: (seen.append(action.copy()), step(action))[1]
    episode = run_episode(loaded, env, deterministic=False, seed=0, record=False)
    assert episode["length"] == 30 and all(BOX.contains(a) for a in seen)
    assert sum(a[0] == BOX.high[0] for a in seen) > 10  # mean 3 over a bound of 1: mostly clipped


# -- float actions through the stores -------------------------------------------------------------------


def box_fragments() -> list[dict]:
    collector = tk.collector(
        policy=wide_policy(), env_fns=[EchoBoxEnv], fragment_length=8, batch_size=1, env_processes=False
    )
    try:
        collector.warmup(timeout=60)
        return collector.collect(2)
    finally:
        collector.close()


def test_float_actions_survive_the_memory_and_lmdb_stores(tmp_path) -> None:
    from mineonline_lmdb import LMDBStore

    frags = [F.seal(f) for f in box_fragments()]
    for store in (MemoryStore(path=str(tmp_path / "mem")), LMDBStore(path=str(tmp_path / "lmdb"))):
        for f in frags:
            store.put(F.fragment_key(f[F.STREAM], f[F.INDEX]), f)
        for f in frags:
            key = F.fragment_key(f[F.STREAM], f[F.INDEX])
            got = store.get(key)
            assert got[F.ACTION].dtype == np.float32 and got[F.ACTION].shape == (8, 2)
            assert_tree_equal(got, f)
            assert F.verify_fragment(key, got) == []
        store.close()


# -- real runs ---------------------------------------------------------------------------------------------

TRAIN = {
    "num_workers": 1,
    "num_cpus_per_worker": 0.5,
    "num_iterations": 3,
    "batch_size_per_gpu": 2,
    "batches_per_iteration": 2,
    "epochs_per_iteration": 2,
    "gradient_accumulation": 1,
    "discount": 0.99,
    "kl_divergence_coef_rho": 0.0,
    "context_length": 16,
    "learning_rate": 3e-4,
    "save_interval": 3,
    "record_video_interval": 0,
}
ROLLOUT = {
    "num_rollout_workers": 1,
    "num_cpus_per_worker": 0.5,
    "fragment_length": 16,
    "worker_config": {"num_envs": 2, "batch_size": 2},
    "replay_buffer_config": {"fragments_per_chunk": 1, "database_config": {"backend": "memory"}},
}


def records_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ppo_trains_the_gaussian_mlp_on_pendulum_and_its_checkpoint_predicts_bounded_actions(
    tmp_path, local_ray
) -> None:
    from mineonline_core.driver.api import run
    from mineonline_core.driver.evaluate import load_policy

    config = {
        "run_name": "pendulum",
        "output_dir": str(tmp_path),
        "env_config": {"name": "gymnasium", "id": "Pendulum-v1"},
        "policy_config": {"name": "mlp", "hidden_sizes": [16, 16]},
        "rollout_config": ROLLOUT,
        "train_config": TRAIN,
        "logger_config": {"loggers": []},
    }
    result = run(config, progress=False, quiet=True)
    assert result["status"] == "completed" and result["summary"]["trainer/iteration"] == 3
    entropy = [r["trainer/entropy"] for r in records_of(tmp_path / "pendulum") if "trainer/entropy" in r]
    # One action dimension at unit std: 0.5 * log(2 pi e) nats, moved a little by three iterations.
    assert entropy and abs(entropy[0] - 0.5 * np.log(2 * np.pi * np.e)) < 0.05, entropy
    loaded = load_policy(tmp_path / "pendulum")
    assert isinstance(loaded.policy.pi_head, GaussianHead)
    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=0)
    torch.manual_seed(0)
    with torch.no_grad():
        loaded.policy.pi_head.log_std.fill_(3.0)  # std e^3: samples leave [-2, 2]; the env must not see them
    actions, _ = loaded.predict(np.stack([obs] * 32))
    assert actions.shape == (32, 1) and actions.dtype == np.float32 and float(np.abs(actions).max()) == 2.0
    env.step(actions[0])


# A Python config module's env: its processes import the module by file, as a user's config is.
MULTIDISCRETE_CONFIG = """
import gymnasium as gym
import numpy as np

NVEC = {nvec!r}


class MultiDiscreteTarget(gym.Env):
    \"\"\"Reward 1 for each dimension of the action that equals the observed target.\"\"\"

    def __init__(self):
        self.observation_space = gym.spaces.Box(0.0, 4.0, (len(NVEC),), np.float32)
        self.action_space = gym.spaces.MultiDiscrete(NVEC)
        self.t, self.target = 0, np.zeros(len(NVEC), np.int64)

    def _obs(self):
        self.target = self.np_random.integers(0, NVEC)
        return self.target.astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {{}}

    def step(self, action):
        action = np.asarray(action)
        assert action.shape == (len(NVEC),) and self.action_space.contains(action), action
        reward = float((action == self.target).sum())
        self.t += 1
        return self._obs(), reward, False, self.t >= 20, {{}}


def env_generator():
    return MultiDiscreteTarget()


online_dict = {online!r}
"""


def test_ppo_trains_the_multi_categorical_mlp_through_the_lmdb_store(tmp_path, local_ray) -> None:
    from mineonline_core.driver.api import run

    source = tmp_path / "multidiscrete_config.py"
    rollout = {**ROLLOUT, "replay_buffer_config": {"fragments_per_chunk": 1, "database_config": {"backend": "lmdb"}}}
    online = {
        "run_name": "md",
        "output_dir": str(tmp_path),
        "policy_config": {"name": "mlp", "hidden_sizes": [16]},
        "rollout_config": rollout,
        "train_config": TRAIN,
        "logger_config": {"loggers": []},
    }
    source.write_text(MULTIDISCRETE_CONFIG.format(nvec=NVEC, online=online))
    result = run(source, progress=False, quiet=True)
    assert result["status"] == "completed" and result["summary"]["trainer/iteration"] == 3
    entropy = [r["trainer/entropy"] for r in records_of(tmp_path / "md") if "trainer/entropy" in r]
    assert entropy and abs(entropy[0] - float(np.log(NVEC).sum())) < 0.05, entropy  # near-uniform at the start
    assert (tmp_path / "md" / "replay_buffer").exists()
