"""A run's local cluster whose raylet misses Ray's fixed 30 s registration window (a busy machine: a CI run
beside other test workers failed so) is started once more, with the processes of the failed start ended and a
warning that says why. Ray's own start-up runs; only its lookup of the new node fails, for the first start."""

from __future__ import annotations

import logging
import os

import pytest


def test_a_start_that_timed_out_is_ended_and_tried_once_more(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import ray
    from ray._private import services

    from mineonline_core.driver import localcluster

    real_get_node, real_init, inits = services.get_node, ray.init, []

    def init(**kwargs):  # type: ignore[no-untyped-def]
        inits.append(kwargs)
        return real_init(**kwargs)

    def get_node(*args, **kwargs):  # type: ignore[no-untyped-def]
        if len(inits) == 1:
            raise RuntimeError("no node info yet")  # what Ray retries for 30 s, in the first start only
        return real_get_node(*args, **kwargs)

    started: list[set[int]] = []
    real_end = localcluster.end

    def end(pids: set[int], **kwargs) -> None:  # type: ignore[no-untyped-def]
        started.append(set(pids))
        real_end(pids, **kwargs)

    monkeypatch.delenv("RAY_worker_niceness", raising=False)  # restored at teardown: the start sets it
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(services, "get_node", get_node)
    monkeypatch.setattr(localcluster, "end", end)
    before = localcluster.children()
    caplog.set_level(logging.WARNING, logger="mineonline")
    try:
        localcluster.start_local_cluster(num_cpus=1, include_dashboard=False, log_to_driver=False)
        assert ray.is_initialized() and len(inits) == 2
        (first,) = started
        assert first and not first & before, first  # the failed start's own processes, none from before
        for pid in first:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # ended and reaped
        assert "starting the local Ray cluster timed out" in caplog.text
    finally:
        ray.shutdown()


def test_another_error_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from mineonline_core.driver import localcluster

    calls: list[dict] = []

    def init(**kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        raise ValueError("num_cpus must be positive")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="num_cpus"):
        localcluster.start_local_cluster(num_cpus=-1)
    assert len(calls) == 1


def test_the_gcs_port_timeout_is_tried_once_more_and_a_second_timeout_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's other start-up timeout (beside two CPU burners a CI run's GCS missed it): the same one retry."""
    import ray

    from mineonline_core.driver import localcluster

    message = "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_1ff3"
    calls: list[dict] = []

    def init(**kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        if len(calls) <= limit:
            raise RuntimeError(message)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(localcluster, "end", lambda pids, **_: None)
    limit = 1
    localcluster.start_local_cluster(num_cpus=1)
    assert len(calls) == 2 and calls[1] == {"address": "local", "num_cpus": 1}
    calls.clear()
    limit = 2
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        localcluster.start_local_cluster(num_cpus=1)
    assert len(calls) == 2


def test_the_workers_run_at_the_drivers_priority_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray starts workers at nice 15, so any busy process took the CPU from the run's rollout and training
    (beside two CPU burners a CartPole run took 8x as long); a local cluster's workers now run at nice 0, and a
    ``RAY_worker_niceness`` the user set is kept."""
    import ray

    from mineonline_core.driver import localcluster

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    try:
        localcluster.start_local_cluster(num_cpus=1, include_dashboard=False, log_to_driver=False)

        @ray.remote(num_cpus=0)
        def niceness() -> int:
            return os.nice(0)

        assert ray.get(niceness.remote(), timeout=120) == os.nice(0)
    finally:
        ray.shutdown()
    monkeypatch.setenv("RAY_worker_niceness", "7")
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    localcluster.start_local_cluster(num_cpus=1)
    assert os.environ["RAY_worker_niceness"] == "7"
