"""FragmentCollector against real env subprocesses and inline envs (no Ray): columns, episode ends,
versions, recurrent-state bookkeeping, the double-buffered weight swap, and env faults (raise, hang,
process death)."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from mineonline_core.contracts import fragment as F
from mineonline_core.errors import RunFailedError
from mineonline_core.testing import kit as tk
from mineonline_core.rollout.collector import FragmentCollector

COLUMNS = {
    F.OBS,
    F.NEXT_OBS,
    F.ACTION,
    F.REWARD,
    F.TERMINATED,
    F.TRUNCATED,
    F.FIRST,
    F.LOGPROB,
    F.VPRED,
    F.BOOTSTRAP,
    F.STATE_IN,
    F.REF_STATE_IN,
    F.EPISODE_ID,
    F.VERSION,
    F.STREAM,
    F.INDEX,
    F.WORKER_ID,
    F.ENV_ID,
}


counting, time_limited, faulty = tk.counting, tk.time_limited_counting, tk.faulty_counting


def make(env_fns, *, policy=None, T=4, batch_size=2, **kwargs) -> FragmentCollector:
    torch.manual_seed(0)
    return tk.collector(
        policy=policy or tk.TinyGRUPolicy(), env_fns=env_fns, fragment_length=T, batch_size=batch_size, **kwargs
    )


def by_stream(frags: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in frags:
        out.setdefault(f[F.STREAM], []).append(f)
    return out


def chain(frags: list[dict], column: str) -> np.ndarray:
    return np.concatenate([f[column] for f in frags])


def replay(policy, frag: dict) -> tuple[np.ndarray, np.ndarray, list]:
    """The training-side forward over one fragment from its ``state_in``: logprobs, values, states."""
    with torch.no_grad():
        state = [torch.as_tensor(s) for s in frag[F.STATE_IN]]
        obs = {"obs": torch.as_tensor(frag[F.OBS]["obs"])[None]}
        first = torch.as_tensor(frag[F.FIRST])[None]
        latents, _ = policy(input=obs, state_in=state, context={"first": first})
        action = torch.as_tensor(frag[F.ACTION])[None]
        logp = policy.pi_head.logprob(action, latents["pi_logits"])[0].numpy()
        vpred = latents["vpred"].reshape(-1).numpy()
        states = []  # the state after each step (step by step, to bootstrap from any t)
        h = state
        for t in range(len(frag[F.REWARD])):
            _, h = policy(input={"obs": obs["obs"][:, t : t + 1]}, state_in=h, context={"first": first[:, t : t + 1]})
            states.append(h)
    return logp, vpred, states


@pytest.mark.parametrize("env_processes", [True, False], ids=["processes", "inline"])
def test_fragment_columns_shapes_and_episode_boundaries(env_processes: bool) -> None:
    c = make(
        [functools.partial(counting, i, image=True) for i in range(3)], T=4, batch_size=2, env_processes=env_processes
    )
    try:
        c.warmup(timeout=120)  # as a worker does: an env process that starts late must not miss the window
        frags = c.collect(18)
    finally:
        c.close()
    f = frags[0]
    assert set(f) == COLUMNS
    assert f[F.OBS]["obs"].shape == (4, 3) and f[F.OBS]["image"].shape == (4, 8, 8, 3)
    assert f[F.OBS]["image"].dtype == np.uint8 and f[F.NEXT_OBS]["obs"].shape == (1, 3)
    assert f[F.ACTION].shape == (4,) and f[F.ACTION].dtype == np.int64
    for col, dtype in (
        (F.REWARD, np.float32),
        (F.LOGPROB, np.float32),
        (F.VPRED, np.float32),
        (F.BOOTSTRAP, np.float32),
        (F.EPISODE_ID, np.int64),
        (F.VERSION, np.int64),
    ):
        assert f[col].shape == (4,) and f[col].dtype == dtype, col
    for col in (F.TERMINATED, F.TRUNCATED, F.FIRST):
        assert f[col].dtype == bool
    assert f[F.STATE_IN][0].shape == (1, 8)
    streams = by_stream(frags)
    assert set(streams) == {"0.0.0", "0.0.1", "0.0.2"}
    for stream, fs in streams.items():
        assert [x[F.INDEX] for x in fs] == list(range(len(fs)))
        assert np.all(chain(fs, F.REWARD) == 1.0)
        counter = np.concatenate([x[F.OBS]["obs"][:, 1] for x in fs])
        episode = np.concatenate([x[F.OBS]["obs"][:, 2] for x in fs])
        first, term = chain(fs, F.FIRST), chain(fs, F.TERMINATED)
        # Step continuity: within an episode the counter goes 0..5; first exactly at 0; the step
        # that reaches 6 is terminal and the next one is first of the next episode.
        assert np.array_equal(first, counter == 0)
        assert np.array_equal(term, counter == 5)
        assert not chain(fs, F.TRUNCATED).any() and not chain(fs, F.BOOTSTRAP).any()
        assert np.array_equal(chain(fs, F.EPISODE_ID), episode.astype(np.int64))
        for a, b in zip(fs, fs[1:]):  # next_obs: the obs after the last step (final obs at a terminal)
            expect = a[F.OBS]["obs"][-1, 1] + 1
            assert a[F.NEXT_OBS]["obs"][0, 1] == expect
            assert b[F.OBS]["obs"][0, 1] == (0 if a[F.TERMINATED][-1] else expect)
    records = c.episode_records()
    assert len(records) >= 6
    assert all(r["return"] == 6.0 and r["length"] == 6 and not r["truncated"] for r in records)
    assert records[0]["discounted_return"] == pytest.approx(sum(0.99**k for k in range(6)))
    assert records[0]["task"] == "count" and records[0]["achievements"] == {"counted": 1}


@pytest.mark.parametrize("env_processes", [True, False], ids=["processes", "inline"])
def test_recurrent_state_and_truncation_bootstrap_reproduce_rollout(env_processes: bool) -> None:
    policy = tk.TinyGRUPolicy()
    c = make(
        [functools.partial(time_limited, i) for i in range(2)],
        policy=policy,
        T=7,
        batch_size=1,
        env_processes=env_processes,
    )
    try:
        frags = c.collect(8)
    finally:
        c.close()
    truncations = 0
    for f in frags:
        logp, vpred, states = replay(policy, f)
        # The training-side forward from state_in, honouring first, reproduces the behaviour policy.
        np.testing.assert_allclose(logp, f[F.LOGPROB], atol=1e-5)
        np.testing.assert_allclose(vpred, f[F.VPRED], atol=1e-5)
        counter = f[F.OBS]["obs"][:, 1]
        np.testing.assert_array_equal(f[F.TRUNCATED], counter == 4)
        assert not f[F.TERMINATED].any()
        for t in np.flatnonzero(f[F.TRUNCATED]):
            truncations += 1
            final = torch.as_tensor(f[F.OBS]["obs"][t].copy())
            final[1] += 1  # the final observation the env returned
            with torch.no_grad():
                latents, _ = policy(
                    input={"obs": final[None, None]},
                    state_in=states[t],
                    context={"first": torch.zeros(1, 1, dtype=torch.bool)},
                )
            assert f[F.BOOTSTRAP][t] == pytest.approx(latents["vpred"].item(), abs=1e-5)
            assert f[F.BOOTSTRAP][t] != 0.0
        assert np.all(f[F.BOOTSTRAP][~f[F.TRUNCATED]] == 0.0)
    assert truncations >= 8
    assert all(r["truncated"] and r["length"] == 5 for r in c.episode_records())


def test_versions_are_tagged_and_weights_swap_between_steps() -> None:
    policy = tk.TinyMLPPolicy()
    c = make([functools.partial(counting, i) for i in range(2)], policy=policy, T=5)
    try:
        before = c.collect(4)
        new = {k: (v + 1.0).numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()}
        c.set_weights(new, 3)
        after = c.collect(6) + c.pop_fragments()
    finally:
        c.close()
    assert all((f[F.VERSION] == 0).all() for f in before)
    for stream, fs in by_stream(before + after).items():
        v = chain(sorted(fs, key=lambda f: f[F.INDEX]), F.VERSION)
        assert np.all(np.diff(v) >= 0) and v[-1] == 3, stream
    assert torch.equal(c.local.policy.state_dict()["body.0.weight"], torch.as_tensor(new["body.0.weight"]))
    assert c.metrics()["rollout/model_version"] == 3.0


def test_weights_load_off_the_stepping_thread_and_only_complete_loads_swap_in() -> None:
    policy = tk.TinyMLPPolicy()
    c = make([functools.partial(counting, i) for i in range(2)], policy=policy, T=5)
    try:
        c.collect(2)
        new = {k: (v + 1.0).numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()}
        c.local._standby_version = None  # as while a load is under way: nothing to swap
        c.step()
        assert c.local.policy is policy and c.version == 0
        c.set_weights(new, 1)  # loads into the standby; the policy stepping now is untouched
        assert c.local.policy is policy and not torch.equal(
            policy.state_dict()["body.0.weight"], torch.as_tensor(new["body.0.weight"])
        )
        newer = {k: v + 1.0 for k, v in new.items()}
        c.set_weights(newer, 2)  # a second load before any step: the latest complete one wins
        c.step()
        assert c.version == 2 and c.local.policy is not policy
        assert torch.equal(c.local.policy.state_dict()["body.0.weight"], torch.as_tensor(newer["body.0.weight"]))
        c.set_weights(new, 3)  # the old policy is the standby now, and is loaded in place
        assert c.local._standby is policy
        c.step()
        assert c.local.policy is policy and c.version == 3
        frags = c.collect(4)
    finally:
        c.close()
    assert max(int(f[F.VERSION].max()) for f in frags) == 3


@pytest.mark.parametrize("mode", ["raise", "kill", "hang", "raise-inline"])
def test_env_fault_is_rebuilt_and_closed_as_truncated(mode: str) -> None:
    mode, _, inline = mode.partition("-")
    fns = [functools.partial(counting, 0, episode_len=50), functools.partial(faulty, 1, at_steps=(7,), mode=mode)]
    # A generous step_timeout except where a hang is the fault: on a machine loaded far beyond its
    # cores a healthy step can take a second, and must not be taken for a hang.
    step_timeout = 2.0 if mode == "hang" else 30.0
    c = make(
        fns,
        policy=tk.TinyMLPPolicy(),
        T=5,
        batch_size=1,
        step_timeout=step_timeout,
        startup_timeout=60,
        backoff_base=0.01,
        env_processes=not inline,
    )
    frags: list[dict] = []
    try:  # until the faulty env has lived through two faults (a rebuild takes longer than a step)
        while sum(f[F.STREAM] == "0.0.1" for f in frags) < 4:
            frags += c.collect(1)
        frags += c.pop_fragments()
    finally:
        c.close()
    m = c.metrics()
    assert m["rollout/env_failures"] >= 1 and m["rollout/env_restarts"] == m["rollout/env_failures"]
    streams = by_stream(frags)
    healthy = sorted(streams["0.0.0"], key=lambda f: f[F.INDEX])
    counter = np.concatenate([f[F.OBS]["obs"][:, 1] for f in healthy])
    assert np.array_equal(counter, np.arange(len(counter)) % 50)  # the other env lost nothing
    assert not chain(healthy, F.TRUNCATED).any()
    broken = sorted(streams["0.0.1"], key=lambda f: f[F.INDEX])
    assert [f[F.INDEX] for f in broken] == list(range(len(broken)))
    counter = np.concatenate([f[F.OBS]["obs"][:, 1] for f in broken])
    trunc, first = chain(broken, F.TRUNCATED), chain(broken, F.FIRST)
    # Each life of the env: 6 good steps, the 7th crashes -> closed as truncated at counter 6,
    # bootstrapped with that step's own value; the next step starts a fresh episode.
    assert np.array_equal(trunc, counter == 6) and trunc.sum() >= 1
    assert np.array_equal(first, counter == 0)
    np.testing.assert_array_equal(chain(broken, F.BOOTSTRAP)[trunc], chain(broken, F.VPRED)[trunc])
    assert np.all(chain(broken, F.REWARD)[trunc] == 0.0)
    assert not chain(broken, F.TERMINATED).any()
    records = [r for r in c.episode_records() if r["stream"] == "0.0.1"]
    # length counts the steps the env completed: the 7th was lost with the env.
    assert records and all(r["truncated"] and r["length"] == 6 for r in records)


def test_env_failing_every_step_fails_loudly_after_max_restarts() -> None:
    fns = [functools.partial(counting, 0), functools.partial(faulty, 1, raise_rate=1.0)]
    c = make(fns, policy=tk.TinyMLPPolicy(), batch_size=1, max_env_restarts=2, backoff_base=0.01)
    try:
        with pytest.raises(RunFailedError, match="max_env_restarts=2"):
            c.collect(10_000)
    finally:
        c.close()
    assert c.pool.env_failures == 3 and c.pool.env_restarts == 2


def test_restart_interval_rebuilds_envs_and_truncates() -> None:
    c = make(
        [functools.partial(counting, i, episode_len=10_000) for i in range(2)],
        policy=tk.TinyMLPPolicy(),
        T=8,
        restart_interval=0.3,
    )
    try:
        end, frags = time.monotonic() + 60, []  # a bound, not a timing: stops at 2 recycled episodes
        while sum(int(f[F.TRUNCATED].sum()) for f in frags) < 2 and time.monotonic() < end:
            frags += c.collect(1)
        frags += c.pop_fragments()
    finally:
        c.close()
    assert c.pool.env_restarts >= 2 and c.pool.env_failures == 0
    trunc = chain(frags, F.TRUNCATED)
    assert trunc.sum() >= 2
    assert np.all(chain(frags, F.BOOTSTRAP)[trunc] != 0.0)
    assert all(r["truncated"] for r in c.episode_records())


def test_video_records_one_whole_episode() -> None:
    c = make([functools.partial(counting, i, episode_len=6, image=True) for i in range(2)], T=4)
    try:
        c.record_video(0)
        c.collect(10)
    finally:
        c.close()
    videos = c.videos()
    assert len(videos) == 1
    v = videos[0]
    assert len(v["frames"]) == len(v["returns"]) == len(v["values"]) == 6
    assert v["returns"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [int(f[0, 0, 0]) for f in v["frames"]] == [0, 1, 2, 3, 4, 5]


def _unimportable_env():  # defined in a test module that env processes cannot import
    return tk.CountingEnv()


def test_env_factory_that_cannot_be_unpickled_fails_at_once_with_the_fix() -> None:
    with pytest.raises(RunFailedError, match="importable module") as info:
        c = make([_unimportable_env], policy=tk.TinyMLPPolicy(), batch_size=1)
        c.collect(1)
    assert "ModuleNotFoundError" in str(info.value)


@pytest.mark.parametrize("env_processes", [False, True])
def test_a_failed_reset_after_a_terminal_keeps_the_terminal_step(env_processes):
    """B1: the step that ended the episode happened; only the automatic reset after it failed."""
    c = make(
        [functools.partial(tk.counting_failing_reset, 0)],
        batch_size=1,
        T=6,
        backoff_base=0.0,
        env_processes=env_processes,
    )
    try:
        frags = c.collect(2)
        records = c.episode_records()
    finally:
        c.close()
    reward, term, trunc = chain(frags, F.REWARD), chain(frags, F.TERMINATED), chain(frags, F.TRUNCATED)
    assert reward.tolist() == [1, 1, 10] * 4
    assert term.tolist() == [False, False, True] * 4 and not trunc.any()
    assert chain(frags, F.FIRST).tolist() == [True, False, False] * 4
    assert [r["return"] for r in records] == [12.0] * 4 and not any(r["truncated"] for r in records)
    assert c.pool.env_failures == 4 and c.pool.env_restarts >= 3
