"""The rollout side's numbers against plain models (tests/oracle/rollout_reference.py).

* A real ``FragmentCollector`` (inline envs, batches smaller than the env count, a KL reference, a
  weight swap mid-run) over envs that terminate, truncate by time limit, do both on one step, and crash:
  every per-step column, the recurrent and reference states at each fragment start, ``next_obs``, and
  every episode record equal a one-env, one-step-at-a-time replay of the same actions.
* ``EpisodeStatistics``' window metrics equal their plain definitions over those episodes.
* ``ReplayBuffer``'s staleness, reuse, eviction and serving order equal a plain model over a seeded
  random sequence of fragments (versions changing inside fragments), version bumps and samples.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import random
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.contracts.policy import ValueHead
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.errors import SampleTimeout
from mineonline_core.rollout.buffer import ReplayBuffer
from mineonline_core.rollout.stats import EpisodeStatistics
from mineonline_core.testing import kit as tk
from mineonline_core.testing.faults import InjectedFault

sys.path.insert(0, str(Path(__file__).parent))  # the oracles beside this file, as test_ppo_oracle imports them
import rollout_reference as ref

DISCOUNT = 0.9
T = 5  # fragment_length: episodes of 3, 4, 5 and 7 steps cross fragment boundaries


def terminating(tag: int) -> gym.Env:
    return tk.CountingEnv(tag=tag, episode_len=3, final_reward=25.0)


def terminated_and_truncated(tag: int) -> gym.Env:
    """The time limit falls on the terminal step: the env reports both flags on one step."""
    return gym.wrappers.TimeLimit(tk.CountingEnv(tag=tag, episode_len=4, final_reward=-6.0), max_episode_steps=4)


ENV_FNS = [
    functools.partial(terminating, 0),
    functools.partial(tk.time_limited_counting, 1, limit=5),
    functools.partial(terminated_and_truncated, 2),
    functools.partial(tk.faulty_counting, 3, episode_len=50, at_steps=(7,), mode="raise"),
]


def gru(seed: int) -> tk.TinyGRUPolicy:
    """A recurrent policy whose value head normalises, with statistics far from (0, 1)."""
    torch.manual_seed(seed)
    policy = tk.TinyGRUPolicy(hidden=8)
    policy.value_head = ValueHead(8, normalize=True, beta=0.9)
    policy.value_head.update_normalizer(torch.tensor([4.0, -9.0, 30.0, 2.0]) * (1 + seed))
    return policy.eval()


def close(actual, expected, *, what: str, rel: float = 1e-5) -> None:
    """Within ``rel`` of the compared quantity's largest magnitude (float32 rollout, one row vs a batch)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(float(np.abs(expected).max(initial=0)), float(np.abs(actual).max(initial=0)), 1e-12)
    error = float(np.abs(actual - expected).max(initial=0))
    assert error <= rel * scale, f"{what}: off by {error:.3g} at scale {scale:.3g}"


def cnn(seed: int) -> torch.nn.Module:
    policy = tk.cnn_policy(seed)
    policy.value_head.update_normalizer(torch.tensor([1.0, -3.0, 6.0]) * (1 + seed))
    return policy.eval()


# Counting envs (every way an episode ends) with a GRU policy; random frames ending at random with the
# core's recurrent CNN.
SCENARIOS = {
    "counting": (ENV_FNS, gru, T, 16),
    "images": ([functools.partial(tk.TinyImageEnv, seed=i, mean_length=4) for i in range(3)], cnn, 6, 6),
}


def _collect(name: str):
    """Fragments and episode records of one collector run, and the weights of each version."""
    env_fns, make_policy, length, per_half = SCENARIOS[name]
    policy, newer, reference = make_policy(0), make_policy(1), make_policy(2)
    policies = {0: copy.deepcopy(policy), 3: copy.deepcopy(newer)}
    c = tk.collector(
        policy=policy,
        env_fns=env_fns,
        fragment_length=length,
        batch_size=2,
        env_processes=False,
        discount=DISCOUNT,
        backoff_base=0.01,
        seed=11,
    )
    try:
        c.set_reference({k: v.numpy() for k, v in reference.state_dict().items()})
        frags = c.collect(per_half)
        c.set_weights({k: v.numpy() for k, v in newer.state_dict().items()}, 3)
        frags += c.collect(per_half) + c.pop_fragments()
        records = c.episode_records()
    finally:
        c.close()
    return env_fns, frags, records, policies, reference


@pytest.fixture(scope="module")
def collected():
    return _collect("counting")


@pytest.fixture(scope="module")
def collected_images():
    return _collect("images")


def replayed(collected) -> dict[str, tuple[list, list, list, list]]:
    """Per stream: (fragments, expected fragments, product episode records, expected episodes)."""
    env_fns, frags, records, policies, reference = collected
    out = {}
    for env_id, env_fn in enumerate(env_fns):
        stream = F.stream_name(0, 0, env_id)
        mine = sorted((f for f in frags if f[F.STREAM] == stream), key=lambda f: f[F.INDEX])
        assert [f[F.INDEX] for f in mine] == list(range(len(mine))), stream
        expected, episodes = ref.replay_stream(
            env_fn=env_fn,
            fragments=mine,
            policies=policies,
            reference=reference,
            discount=DISCOUNT,
            lost_errors=(InjectedFault,),
        )
        out[stream] = (mine, expected, [r for r in records if r["stream"] == stream], episodes)
    return out


@pytest.mark.parametrize("scenario", ["counting", "images"])
def test_every_fragment_column_equals_a_plain_rollout_loop(scenario, request):
    collected = request.getfixturevalue("collected" if scenario == "counting" else "collected_images")
    seen = {"terminated": 0, "truncated": 0, "reset_inside": 0, "swapped": 0}
    if scenario == "counting":
        seen["lost"] = 0
    for stream, (frags, expected, _, _) in replayed(collected).items():
        for frag, want in zip(frags, expected):
            where = f"stream {stream} fragment {frag[F.INDEX]}"
            for key in frag[F.OBS]:
                np.testing.assert_array_equal(frag[F.OBS][key], np.stack([o[key] for o in want["obs"]]), err_msg=where)
            for column in (F.TERMINATED, F.TRUNCATED, F.FIRST, F.EPISODE_ID):
                np.testing.assert_array_equal(frag[column], want[column], err_msg=f"{where}: {column}")
            close(frag[F.REWARD], want["reward"], what=f"{where}: reward")
            close(frag[F.LOGPROB], want["logprob"], what=f"{where}: logprob")
            close(frag[F.VPRED], want["vpred"], what=f"{where}: vpred")
            for t, choices in enumerate(want["bootstrap_choices"]):
                # A truncation's bootstrap runs in the next batch, which may already have the next weights.
                assert any(abs(frag[F.BOOTSTRAP][t] - c) <= 1e-5 * max(abs(c), 1.0) for c in choices), (
                    f"{where}: bootstrap[{t}] = {frag[F.BOOTSTRAP][t]}, expected one of {choices}"
                )
            for key in frag[F.NEXT_OBS]:
                close(frag[F.NEXT_OBS][key][0], want["next_obs"][key], what=f"{where}: next_obs {key}")
            close(frag[F.STATE_IN][0], want["state_in"][0], what=f"{where}: state_in")
            close(frag[F.REF_STATE_IN][0], want["ref_state_in"][0], what=f"{where}: ref_state_in")
            seen["terminated"] += int(frag[F.TERMINATED].sum())
            seen["truncated"] += int(frag[F.TRUNCATED].sum())
            if "lost" in seen:  # the crashing env's truncations carry no reward
                seen["lost"] += int((frag[F.TRUNCATED] & (frag[F.REWARD] == 0)).sum())
            seen["reset_inside"] += int(frag[F.FIRST][1:].any())
            seen["swapped"] += int((frag[F.VERSION] == 3).any())
    assert all(count > 0 for count in seen.values()), seen


def test_versions_name_the_weights_that_chose_each_action(collected):
    """Each step's version is the weights whose log-prob of the action was recorded: the replay
    under the other weights does not reproduce it."""
    _, frags, _, policies, _ = collected
    for stream, (mine, expected, _, _) in replayed(collected).items():
        versions = np.concatenate([f[F.VERSION] for f in mine])
        assert set(np.unique(versions)) == {0, 3} and np.all(np.diff(versions) >= 0), stream
    swapped = {v: k for k, v in {0: 3, 3: 0}.items()}
    stream = F.stream_name(0, 0, 1)
    mine = sorted((f for f in frags if f[F.STREAM] == stream), key=lambda f: f[F.INDEX])
    wrong = [{**f, F.VERSION: np.vectorize(swapped.get)(f[F.VERSION])} for f in mine]
    expected, _ = ref.replay_stream(
        env_fn=ENV_FNS[1], fragments=wrong, policies=policies, reference=None, discount=DISCOUNT
    )
    logprob = np.concatenate([f[F.LOGPROB] for f in mine])
    assert np.abs(logprob - np.concatenate([w["logprob"] for w in expected])).max() > 1e-2


@pytest.mark.parametrize("scenario", ["counting", "images"])
def test_episode_records_and_statistics_equal_their_definitions(scenario, request):
    collected = request.getfixturevalue("collected" if scenario == "counting" else "collected_images")
    matched = []
    for stream, (_, _, records, episodes) in replayed(collected).items():
        assert episodes, stream
        # Records of episodes that ended in a fragment not yet complete come after these.
        assert len(records) >= len(episodes), stream
        for record, want in zip(records, episodes):
            assert record["length"] == want["length"] and record["truncated"] == want["truncated"], (stream, record)
            assert record["task"] == want["task"]
            close(record["return"], want["return"], what=f"{stream}: return", rel=1e-9)
            close(record["discounted_return"], want["discounted_return"], what=f"{stream}: discounted", rel=1e-9)
        matched += records[: len(episodes)]
        # The plain sum of gamma^t r_t, written out once more for the terminating env's 3-step episodes.
        if scenario == "counting" and stream == F.stream_name(0, 0, 0):
            assert records[0]["discounted_return"] == pytest.approx(1 + DISCOUNT + DISCOUNT**2 * 25.0)
    stats = EpisodeStatistics(window=1000, report_every=10**6)
    stats.add_episodes(matched)
    summary = stats.summary()
    episodes = [e for *_, eps in replayed(collected).values() for e in eps]
    for key, value in ref.plain_episode_summary(episodes).items():
        close(summary[key], value, what=key, rel=1e-9)


# -- the replay buffer's bookkeeping ------------------------------------------------------------------


def _fragment(stream: str, index: int, versions: list[int]) -> dict:
    return {
        F.STREAM: stream,
        F.INDEX: index,
        F.VERSION: np.asarray(versions, np.int64),
        F.REWARD: np.full(len(versions), float(index), np.float32),
        F.LOGPROB: np.zeros(len(versions), np.float32),
    }


STAT_KEYS = (
    "replay/size",
    "replay/version",
    "replay/staleness_mean",
    "replay/reuse_mean",
    "replay/fragments_added",
    "replay/dropped_stale",
    "replay/dropped_gap",
    "replay/evicted",
    "replay/used_up",
    "replay/chunks_served",
)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buffer_staleness_and_reuse_equal_a_plain_model(seed):
    """Three streams add fragments whose steps span a version bump, with occasional gaps; the trainer
    bumps the version and samples (some ahead, for a later version; some in rounds of two ranks)."""
    rng = random.Random(seed)
    settings = {"max_chunks": 6, "max_reuse": 2, "max_staleness": 3, "fragments_per_chunk": 2}
    model = ref.PlainBuffer(**settings)

    async def go() -> int:
        store = MemoryStore(path="unused")
        buffer = ReplayBuffer(store_client=store, fragments_per_report=10**6, **settings)
        next_index = {s: 0 for s in ("0.0.0", "0.0.1", "0.0.2")}
        rollout_version, version, served = 0, 0, 0
        for step in range(220):
            op = rng.random()
            if op < 0.6:
                stream = rng.choice(sorted(next_index))
                next_index[stream] += rng.choice([2, 3]) if rng.random() < 0.08 else 1  # lost fragments now and then
                index = next_index[stream]
                lag = rng.choice([0, 0, 1, 2, 5])  # a slow worker's fragments are older
                old = max(rollout_version - lag, 0)
                versions = [old] * 2 + [min(old + 1, rollout_version)] * 2  # the weights swap mid-fragment
                frag = _fragment(stream, index, versions)
                meta = fragment_meta(frag)
                store.put(meta["key"], frag)
                await buffer.add_fragment(meta)
                model.add(stream, index, versions)
            elif op < 0.75:
                version += 1
                rollout_version = version
                await buffer.set_version(version)
                model.set_version(version)
            else:
                ahead = rng.choice([None, version, version + 1])
                round_id = rng.choice([None, step // 10])
                eligible = len(model.eligible(ahead))
                k = rng.choice([1, 2, eligible + 1])
                if k > settings["max_chunks"]:
                    continue
                if k > eligible:  # one more than the model allows: the product must find no more eligible either
                    with pytest.raises(SampleTimeout):
                        await buffer.sample(k, ahead, 0.01, round_id=round_id)
                elif k:
                    got = await buffer.sample(k, ahead, 0.5, round_id=round_id)
                    want = model.sample(k, ahead, round_id)
                    assert [(c["chunk_id"], c["version"], c["reuse"]) for c in got] == want, step
                    await buffer.release([c["chunk_id"] for c in got])
                    served += len(got)
            stats = buffer.stats()
            plain = model.stats()
            for key in STAT_KEYS:
                assert stats[key] == pytest.approx(plain[key], rel=1e-12, abs=0), (step, key)
        return served

    assert asyncio.run(go()) > 20
