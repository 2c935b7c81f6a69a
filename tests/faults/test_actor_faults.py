"""Actor faults on a real rollout side (``RolloutManager`` with its buffer, statistics, store host
and workers on a local Ray cluster): a SIGKILLed rollout worker is restarted by Ray and rejoins with
the current weights; a dead bookkeeping actor fails the run loudly, with the cause.

The tests wait for events (the restarted worker's fragments, health() raising), each under a generous
timeout that names the event that never came; how long recovery took is printed as a FIGURE, never
asserted: on a loaded machine it is the load that decides it.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest

from mineonline_core.contracts import fragment as F
from mineonline_core.services.names import NAMESPACE, actor_name
from mineonline_core.testing import kit as tk
from mineonline_core.testing.envs import paced_counting
from mineonline_core.testing.faults import stream_report

T = 8


def _config(tmp_path, run_name: str, **rollout):
    from mineonline_core.config import load_config

    data = {
        "run_name": run_name,
        "output_dir": str(tmp_path),
        "seed": 0,
        "rollout_config": {
            "num_rollout_workers": 1,
            "num_cpus_per_worker": 0.5,
            "fragment_length": T,
            "worker_config": {"num_envs": 2, "batch_size": 2, "step_timeout": 10.0},
            "replay_buffer_config": {
                "max_chunks": 100000,
                "max_staleness": 1000,
                "fragments_per_chunk": 1,
                "database_config": {"backend": "lmdb"},
            },
            **rollout,
        },
        "train_config": {"context_length": T, "num_workers": 1, "num_cpus_per_worker": 0.5, "batch_size_per_gpu": 1},
        "logger_config": {"loggers": []},
    }
    return load_config(data).config


def _start(tmp_path, run_name: str, env_fn=None, **rollout):
    import ray
    from mineonline_lmdb.store import LMDBStore

    from mineonline_core.contracts.envs import adapted
    from mineonline_core.rollout.manager import launch_rollout_manager

    cfg = _config(tmp_path, run_name, **rollout)
    # No trainer: paced, so that the rollout does not fill the store flat out while the tests wait for events.
    env_fn = adapted(env_fn or functools.partial(paced_counting, tag=3.0, episode_len=1000))
    manager = launch_rollout_manager(
        policy_generator=functools.partial(tk.TinyMLPPolicy), env_generator=env_fn, config=cfg, store_cls=LMDBStore
    )
    ray.get(manager.wait_ready.remote(180), timeout=240)
    return manager


def _broadcast(manager, version: int) -> None:
    import ray

    weights = {k: v.numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()}
    ray.get(manager.update_weights.remote([ray.put(weights)], version))


def _wait(predicate, timeout: float, what: str, last=lambda: None):
    """Poll ``predicate`` until it returns a truthy value; on timeout, name the event (``what``) and
    what ``last()`` says was seen instead."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)  # polling a remote condition
    seen = last()
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}" + (f"; last seen: {seen}" if seen else "")
    )


def _buffer_size(manager) -> float:
    import ray

    return ray.get(ray.get(manager.get_buffer.remote()).stats.remote())["replay/size"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(manager) -> None:
    import ray

    try:
        ray.get(manager.shutdown.remote(), timeout=60)
    finally:
        ray.kill(manager)


def test_killed_rollout_worker_is_restarted_with_current_weights(ray_cluster, tmp_path) -> None:
    import ray

    manager = _start(tmp_path, "kill-worker")
    try:
        _broadcast(manager, 1)
        _wait(lambda: _buffer_size(manager) >= 4, 120, "fragments from the first worker life")
        (worker,) = ray.get(manager.get_workers.remote())
        pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
        env_pids = ray.get(worker.__ray_call__.remote(lambda self: self.collector.pool.pids()))
        _broadcast(manager, 2)
        _wait(lambda: ray.get(worker.status.remote())["version"] == 2, 60, "version 2 in the worker")
        before = _buffer_size(manager)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        seen: list[dict] = []

        def rejoined():
            status = ray.get(manager.status.remote(), timeout=30)
            (w,) = status["workers"]
            seen.append(w)
            return w if w.get("incarnation") == 1 and w.get("ready") and w.get("fragments_sent", 0) >= 2 else None

        status = _wait(
            rejoined,
            300,
            "the restarted worker (incarnation 1) to send 2 fragments",
            last=lambda: seen[-1] if seen else None,
        )
        recovered_s = time.monotonic() - killed_at
        assert status["version"] == 2  # rejoined with the current weights, not the initial ones
        ray.get(manager.health.remote())  # a restarted worker is not a failure of the run
        assert not any(_pid_alive(p) for p in [pid, *env_pids])  # no orphan env processes

        store = ray.get(manager.get_store_client.remote())
        keys = store.keys()
        frags = store.get_many(keys)
        for key, frag in zip(keys, frags):
            assert key == F.fragment_key(frag[F.STREAM], frag[F.INDEX])  # no swapped payload
        report = stream_report(frags)
        assert {"0.0.0", "0.0.1", "0.1.0", "0.1.1"} <= set(report)
        assert all(r["missing"] == [] and r["indices"][0] == 0 and r["broken_boundaries"] == 0 for r in report.values())
        new_life = [f for f in frags if f[F.STREAM].startswith("0.1.")]
        assert new_life and all(int(f[F.VERSION].min()) == 2 for f in new_life)
        steps_after = sum(len(f[F.REWARD]) for f in new_life)
        assert steps_after >= 2 * T
        print(
            f"FIGURE worker SIGKILL: restarted (incarnation 1), rejoined at version 2 in {recovered_s:.1f}s, "
            f"{steps_after} steps after it, {before:.0f} chunks before, 0 gaps in {len(report)} streams"
        )
    finally:
        _stop(manager)


# actor name suffix -> a word the failure message must contain
DEAD = {"replay_buffer": "replay", "episode_statistics": "statistics", "store_host": "store"}


@pytest.mark.parametrize("which", ["replay_buffer", "episode_statistics", "store_host"])
def test_dead_bookkeeping_actor_fails_the_run_loudly(ray_cluster, tmp_path, which: str) -> None:
    import ray

    cause = DEAD[which]
    run = f"dead-{which.replace('_', '-')}"
    manager = _start(tmp_path, run)
    try:
        _broadcast(manager, 1)
        _wait(lambda: _buffer_size(manager) >= 1, 120, "first fragments")
        actor = ray.get_actor(actor_name(run, which), namespace=NAMESPACE)
        # Dead for good: Ray restarts the statistics and the store host after a crash (tests/faults/
        # test_actor_deaths.py); one that cannot come back (its restarts spent, a store that no longer opens)
        # ends the run with its cause.
        ray.kill(actor, no_restart=True)
        killed_at = time.monotonic()

        def failed():
            try:
                ray.get(manager.health.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:
                return None  # a busy manager is no answer yet: ask again
            except Exception as exc:  # noqa: BLE001 - the failure we wait for
                return str(exc)
            return None

        message = _wait(failed, 180, f"health() to report the dead {which} actor")
        detected_s = time.monotonic() - killed_at
        assert "RunFailedError" in message and cause in message.lower(), message
        if which == "store_host":  # the store's path and what to do
            path = str(tmp_path / run / "replay_buffer")
            assert f"database_config.path={path!r}" in message and "--resume" in message, message
        print(f"FIGURE dead {which}: health() raised after {detected_s:.1f}s: {' '.join(message.split())[:400]}")
    finally:
        _stop(manager)


def test_worker_crash_loop_is_capped_and_fails_the_run(ray_cluster, tmp_path) -> None:
    """A worker that dies at every start (an inline env SIGKILLs it at its third step) is restarted
    max_worker_restarts times, then the run fails naming the cap and each worker's last error."""
    import ray

    from mineonline_core.testing.faults import FaultyEnvFactory

    crash = FaultyEnvFactory(functools.partial(tk.CountingEnv, tag=3.0, episode_len=1000), kill_at_step=3)
    worker_config = {"num_envs": 2, "batch_size": 2, "step_timeout": 10.0, "env_processes": False}
    manager = _start(
        tmp_path, "crash-loop", env_fn=crash, max_worker_restarts=2, restart_window=600.0, worker_config=worker_config
    )
    try:
        _broadcast(manager, 1)  # the first life steps, and dies
        started = time.monotonic()

        def failed():
            try:
                ray.get(manager.health.remote(), timeout=30)
            except ray.exceptions.GetTimeoutError:
                return None  # a busy manager is no answer yet: ask again
            except Exception as exc:  # noqa: BLE001 - the failure we wait for
                return str(exc)
            return None

        # Three lives started and crashed: past 240 s beside the suite and two CPU burners.
        message = _wait(failed, 540, "health() to report the crash loop")
        assert "restarted 3 times" in message and "max_worker_restarts=2 per restart_window=600s" in message, message
        assert "rollout worker 0: " in message and "last error:" in message
        assert ray.get(manager.status.remote())["incarnations"][0] >= 3
        print(
            f"FIGURE worker crash loop: run failed after 3 restarts in {time.monotonic() - started:.1f}s: "
            f"{' '.join(message.split())[:300]}"
        )
    finally:
        _stop(manager)
