"""Env faults through the real ``FragmentCollector`` (env subprocesses, no Ray).

One env of three is faulty (``FaultyEnvFactory``); the other two are clean ``CountingEnv``s whose
observation ``[tag, t, episode]`` tells exactly which env produced a step and where it was. For each
fault we assert: the failures the collector counted equal the faults injected, every failure led to
a rebuild, the interrupted episode was closed as truncated and reported, the faulty env went on
producing steps, and the clean envs' streams are complete (no gap), consistent and untouched.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from mineonline_core.contracts import fragment as F
from mineonline_core.errors import RunFailedError
from mineonline_core.rollout.collector import FragmentCollector
from mineonline_core.testing import kit as tk
from mineonline_core.testing.faults import FaultyEnvFactory, injected_faults, stream_report

T = 8


def counting(tag: float) -> functools.partial:
    # Env functions are unpickled in env subprocesses: they must be importable, hence a partial.
    return functools.partial(tk.CountingEnv, tag=tag, episode_len=1000)  # long episodes: every end is a fault


def run(
    faulty: FaultyEnvFactory, *, fragments: int, faulty_fragments: int = 0, limit_s: float = 300.0, **kwargs
) -> tuple[FragmentCollector, list[dict], list[dict], float]:
    """Collect at least ``fragments``, of which ``faulty_fragments`` from the faulty env (stream 0.0.0).

    The collector does not wait for an env that is down or slow when others are ready, so the clean
    envs alone could fill ``fragments``; asking for the faulty env's fragments makes each run wait
    through the fault and the rebuild, whatever the machine's speed.
    """
    torch.manual_seed(0)
    fns = [faulty, counting(1.0), counting(2.0)]
    collector = tk.collector(
        policy=tk.TinyMLPPolicy(),
        env_fns=fns,
        fragment_length=T,
        batch_size=2,
        backoff_base=0.05,
        backoff_max=0.5,
        **kwargs,
    )
    start = time.monotonic()
    frags: list[dict] = []
    try:
        while len(frags) < fragments or sum(f[F.STREAM] == "0.0.0" for f in frags) < faulty_fragments:
            # A deadline, not a fragment count: the clean envs keep stepping during the fault and the rebuild.
            # Generous (a loaded machine is slow): it only ends a run whose faulty env never comes back.
            assert time.monotonic() - start < limit_s, (
                f"the faulty env produced no fragment again within {limit_s:.0f}s"
            )
            frags += collector.collect(1)
        elapsed = time.monotonic() - start
        records = collector.episode_records()
    finally:
        collector.close()
    return collector, frags, records, elapsed


def assert_clean_streams_untouched(frags: list[dict], report: dict) -> None:
    for stream, tag in (("0.0.1", 1.0), ("0.0.2", 2.0)):
        mine = sorted((f for f in frags if f[F.STREAM] == stream), key=lambda f: f[F.INDEX])
        assert mine, f"no data from clean env {stream}"
        obs = np.concatenate([f[F.OBS]["obs"] for f in mine])
        assert np.all(obs[:, 0] == tag)  # no step of another env leaked in
        first = np.concatenate([f[F.FIRST] for f in mine])
        steps = np.arange(len(obs))
        since_start = steps - np.maximum.accumulate(np.where(first, steps, 0))
        assert first[0] and np.array_equal(obs[:, 1], since_start)  # t counts 0,1,2,... per episode: no step lost
        assert not np.any(np.concatenate([f[F.TRUNCATED] for f in mine]))
        assert report[stream]["missing"] == [] and report[stream]["indices"][0] == 0
        assert report[stream]["broken_boundaries"] == 0


def assert_faulty_stream_consistent(frags: list[dict], report: dict) -> np.ndarray:
    mine = sorted((f for f in frags if f[F.STREAM] == "0.0.0"), key=lambda f: f[F.INDEX])
    assert report["0.0.0"]["missing"] == [] and report["0.0.0"]["broken_boundaries"] == 0
    obs = np.concatenate([f[F.OBS]["obs"] for f in mine])
    first = np.concatenate([f[F.FIRST] for f in mine])
    trunc = np.concatenate([f[F.TRUNCATED] for f in mine])
    assert np.all(obs[:, 0] == 0.0)
    assert np.array_equal(first, obs[:, 1] == 0)  # a new episode starts at t=0, in a fresh env
    # Within an episode t counts up by one: the env was never stepped without the step being kept.
    steps_in_episode = np.diff(obs[:, 1])[~first[1:]]
    assert np.all(steps_in_episode == 1)
    reward = np.concatenate([f[F.REWARD] for f in mine])
    assert np.all(reward[trunc] == 0.0) and np.all(reward[~trunc] == 1.0)  # the failed step earned nothing
    return trunc


def test_exceptions_at_a_rate(tmp_path) -> None:
    """Env crashes on 1% of steps: every fragment goes through the LMDB store and comes back with the
    checksum its worker computed, and no stream has a gap."""
    from mineonline_lmdb import LMDBStore

    from mineonline_core.contracts.fragment import fragment_meta, verify_fragment

    faulty = FaultyEnvFactory(counting(0.0), step_error_rate=0.01, seed=2, state_dir=str(tmp_path / "faults"))
    collector, frags, records, _ = run(faulty, fragments=120, faulty_fragments=60, step_timeout=30.0)
    injected = injected_faults(tmp_path / "faults")["step_error"]
    report = stream_report(frags)
    assert_clean_streams_untouched(frags, report)
    trunc = assert_faulty_stream_consistent(frags, report)
    assert injected >= 3
    # The collector may stop with one fault sent but not yet received.
    assert collector.pool.env_failures in (injected, injected - 1)
    assert collector.pool.env_restarts in (collector.pool.env_failures, collector.pool.env_failures - 1)
    assert int(trunc.sum()) <= collector.pool.env_failures
    truncated_records = [r for r in records if r["truncated"]]
    assert 1 <= len(truncated_records) <= collector.pool.env_failures
    assert all(r["stream"] == "0.0.0" for r in truncated_records)
    metrics = collector.metrics()
    assert metrics["rollout/env_failures"] == collector.pool.env_failures
    assert metrics["rollout/env_restarts"] == collector.pool.env_restarts
    store = LMDBStore(path=str(tmp_path / "store"), num_shards=2, resume=False)
    try:
        metas = [fragment_meta(f) for f in frags]
        store.put_many([(m["key"], f) for m, f in zip(metas, frags)])
        back = store.get_many([m["key"] for m in metas])
    finally:
        store.close()
    corrupt = sum(bool(verify_fragment(m["key"], b, checksum=m["checksum"])) for m, b in zip(metas, back))
    assert corrupt == 0 and all(r["missing"] == [] for r in report.values())
    print(
        f"FIGURE env exceptions at 1%: {injected} injected, {collector.pool.env_failures} failures, "
        f"{collector.pool.env_restarts} rebuilds, {len(frags)} fragments through LMDB: 0 lost, 0 checksum mismatches"
    )


@pytest.mark.parametrize("kind", ["hang", "kill", "raise"])
def test_one_fault_rebuild_and_recovery(tmp_path, kind: str) -> None:
    at = {"hang": "hang_at_step", "kill": "kill_at_step", "raise": "raise_at_step"}[kind]
    faulty = FaultyEnvFactory(counting(0.0), once=True, state_dir=str(tmp_path), hang_s=60.0, **{at: 2 * T + 3})
    collector, frags, records, elapsed = run(faulty, fragments=12, faulty_fragments=4, step_timeout=1.5)
    injected = injected_faults(tmp_path)
    assert injected[{"raise": "step_error"}.get(kind, kind)] == 1 and injected["lives"] == 2
    assert collector.pool.env_failures == 1 and collector.pool.env_restarts == 1
    report = stream_report(frags)
    assert_clean_streams_untouched(frags, report)
    trunc = assert_faulty_stream_consistent(frags, report)
    assert int(trunc.sum()) == 1 and int(np.flatnonzero(trunc)[0]) == 2 * T + 2  # the step that failed
    after = report["0.0.0"]["steps"] - (2 * T + 3)
    assert after >= T  # the rebuilt env went on collecting
    (record,) = [r for r in records if r["stream"] == "0.0.0"]
    assert record["truncated"] and record["length"] == 2 * T + 2
    print(
        f"FIGURE env {kind}: 1 fault, 1 rebuild, {after} steps after it, 0 fragments lost, "
        f"{elapsed:.1f}s for {len(frags)} fragments"
    )
    if kind == "hang":
        # Detected by step_timeout, not by the hang ending (60 s): a hang that ends is a step that
        # succeeds, and env_failures == 1 with the step truncated above says the step failed.
        assert elapsed >= 1.5


def test_reset_faults_are_retried_until_the_env_comes_up(tmp_path) -> None:
    faulty = FaultyEnvFactory(counting(0.0), reset_error_rate=0.6, seed=6, state_dir=str(tmp_path))
    collector, frags, _, _ = run(faulty, fragments=9, faulty_fragments=1, step_timeout=30.0)
    injected = injected_faults(tmp_path)
    assert injected["reset_error"] == 2 and injected["lives"] == 3  # seed 6: lives 0 and 1 fail to reset
    assert (
        collector.pool.env_failures == injected["reset_error"]
        and collector.pool.env_restarts == injected["reset_error"]
    )
    report = stream_report(frags)
    assert_clean_streams_untouched(frags, report)
    assert report["0.0.0"]["steps"] >= T and report["0.0.0"]["truncated"] == 0  # no episode was running yet


@pytest.mark.parametrize("kind", ["nan_reward", "nan_obs"])
def test_nonfinite_answers_never_reach_a_fragment(tmp_path, caplog, kind: str) -> None:
    """The issue's case: an env answers a NaN reward (or observation) on 1% of its steps."""
    faulty = FaultyEnvFactory(counting(0.0), seed=3, state_dir=str(tmp_path), **{f"{kind}_rate": 0.01})
    with caplog.at_level("WARNING", logger="mineonline_core.rollout.collector"):
        collector, frags, records, _ = run(faulty, fragments=60, faulty_fragments=60, step_timeout=30.0)
    injected = injected_faults(tmp_path)[kind]
    assert injected >= 2
    for frag in frags:
        for column in (F.REWARD, F.LOGPROB, F.VPRED, F.BOOTSTRAP):
            assert np.all(np.isfinite(frag[column])), (column, frag[F.STREAM])
        assert np.all(np.isfinite(frag[F.OBS]["obs"])) and np.all(np.isfinite(frag[F.NEXT_OBS]["obs"]))
    assert collector.pool.env_nonfinite in (injected, injected - 1)  # one may still be in flight at the end
    pool = collector.pool
    assert pool.env_failures == pool.env_nonfinite and pool.env_restarts == 0  # reset, not rebuilt
    assert collector.metrics()["rollout/env_nonfinite"] == collector.pool.env_nonfinite
    report = stream_report(frags)
    assert_clean_streams_untouched(frags, report)
    trunc = assert_faulty_stream_consistent(frags, report)
    assert int(trunc.sum()) == collector.pool.env_nonfinite  # each bad step closed its episode as truncated
    key = "reward is nan" if kind == "nan_reward" else "observation key 'obs'"
    lines = [r.getMessage() for r in caplog.records if "worker 0 env 0:" in r.getMessage() and key in r.getMessage()]
    assert len(lines) == collector.pool.env_nonfinite, [r.getMessage() for r in caplog.records][:5]
    print(
        f"FIGURE env {kind} at 1%: {injected} injected, {collector.pool.env_nonfinite} steps failed and reset, "
        f"0 non-finite values in {len(frags)} fragments"
    )


def test_env_rebuilds_are_capped_per_window(tmp_path) -> None:
    """An env that fails at every start (and any crash loop) ends the run, naming the cap and the last failure."""
    faulty = FaultyEnvFactory(counting(0.0), reset_error_rate=1.0, state_dir=str(tmp_path))
    started = time.monotonic()
    with pytest.raises(RunFailedError) as failure:
        run(faulty, fragments=1000, faulty_fragments=1, step_timeout=30.0, max_env_rebuilds=5, restart_window=60.0)
    message = str(failure.value)
    assert "rebuilt 6 times" in message and "max_env_rebuilds=5 per rollout_config.restart_window=60s" in message
    assert "env 0:" in message and "injected reset fault" in message
    assert injected_faults(tmp_path)["lives"] == 6  # the first build and 5 rebuilds, then the sixth rebuild is refused
    print(f"FIGURE env failing at every start: run failed after {time.monotonic() - started:.1f}s and 5 rebuilds")
