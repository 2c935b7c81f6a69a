"""Cluster faults on a multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head with
0 CPUs and two worker nodes of 2 CPUs, token authentication on (``RAY_AUTH_MODE=token`` for the cluster's
processes; the drivers are the real ``mineonline run --address`` in a subprocess without any ``RAY_*``
variable, so presenting the token is the CLI's job).

Nodes are killed as a crash kills them (``allow_graceful=False``: SIGKILL of the raylet and its workers),
then a replacement node is added, as an autoscaler would. The tests assert events (a restart logged,
iterations continuous, where actors sit, an error naming the cause), never seconds.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mineonline_core.testing.envs import PACED_CARTPOLE
from mineonline_core.testing.faults import live_records
from mineonline_core.testing.fixtures import start_cluster

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("rollout_manager", "replay_buffer", "episode_statistics", "logger_hub", "store_host")


def _config(tmp_path: Path, run_name: str, **train) -> Path:
    data = yaml.safe_load((ROOT / "examples" / "cartpole.yaml").read_text())
    data.update(run_name=run_name, output_dir=str(tmp_path / "runs"), seed=0)
    data["env_config"]["id"] = PACED_CARTPOLE
    data["rollout_config"].update(
        num_rollout_workers=2,
        num_cpus_per_worker=0.5,
        fragment_length=16,
        worker_config={"num_envs": 2, "batch_size": 2},
    )
    data["train_config"].update(
        {
            "num_iterations": 100_000,
            "num_cpus_per_worker": 1,
            "batches_per_iteration": 1,
            "batch_size_per_gpu": 2,
            "epochs_per_iteration": 1,
            "context_length": 16,
            "save_interval": 1,
            "keep_interval": 1,
            **train,
        }
    )
    path = tmp_path / f"{run_name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _driver(tmp_path: Path, config: Path, address: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    out = tmp_path / f"{config.stem}.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mineonline_core.cli",
                "run",
                str(config),
                "--no-progress",
                "--address",
                address,
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc, out


def _iterations(run_dir: Path) -> list[int]:
    return [int(r["trainer/iteration"]) for r in live_records(run_dir) if "trainer/iteration" in r]


def _wait(proc: subprocess.Popen, out: Path, predicate, what: str, timeout: float = 400.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the driver ended (rc {proc.returncode}) before {what}:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < end, f"{what} not within {timeout:.0f} s:\n{out.read_text()[-3000:]}"
        time.sleep(0.5)  # polling the run's files


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(2)  # SIGINT: the supervising parent forwards it, the run stops with a checkpoint
        try:
            return proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode


def _actor_nodes(run: str) -> dict[str, tuple[str, int]]:
    """Alive actors of the cluster: name (or class) -> (node id, restarts)."""
    import ray

    out = {}
    for info in ray._private.state.actors().items():
        info = info[1]
        if info["State"] == "ALIVE":
            name = info["Name"] or info["ActorClassName"]
            out[name.removeprefix(run + "/")] = (info["Address"]["NodeID"], int(info["NumRestarts"]))
    return out


def _run_actors(run: str) -> list[str]:
    """The actors of run ``run`` the cluster has seen, alive or dead."""
    import ray

    return sorted(
        info["Name"] for info in ray._private.state.actors().values() if (info["Name"] or "").startswith(run + "/")
    )


@contextlib.contextmanager
def _token_mode():
    """``RAY_AUTH_MODE=token`` in this process (and the cluster processes it starts), as Ray 2.60 sets it
    for a cluster it starts; Ray caches its config at import, so it is asked to read it again."""
    from ray._raylet import Config

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "token")
        Config.initialize("")
        try:
            yield
        finally:
            mp.undo()
            Config.initialize("")


@pytest.fixture(scope="module")
def cluster():
    import ray

    with _token_mode():
        # A head with no CPUs, two worker nodes of two.
        cluster = start_cluster({"num_cpus": 0, "include_dashboard": False}, [{"num_cpus": 2}] * 2)
        ray.init(address=cluster.address, namespace="mineonline", log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def _kill_node_of(cluster, node_id: str) -> None:
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node, allow_graceful=False)  # SIGKILL: a crash, not a drain
    cluster.add_node(num_cpus=2)  # the replacement an autoscaler would bring


def test_lost_nodes_cost_only_their_workers_and_ranks(cluster, tmp_path: Path) -> None:
    """The bookkeeping actors sit on the driver's node (the head); killing the node of rollout worker 0,
    then the node of the Ray Train rank, restarts what was on it: the run goes on with continuous
    iterations, the rank from the latest checkpoint, and no bookkeeping actor restarts."""
    run, run_dir = "lost-nodes", tmp_path / "runs" / "lost-nodes"
    proc, out = _driver(tmp_path, _config(tmp_path, run, use_ray_train=True, max_trainer_restarts=2), cluster.address)
    try:
        _wait(proc, out, lambda: max(_iterations(run_dir), default=0) >= 1, "iteration 1 (and its checkpoint)")
        head = cluster.head_node.node_id
        before = _actor_nodes(run)
        assert {name: before[name][0] for name in NAMES} == {name: head for name in NAMES}, before
        worker_node, rank_node = before["rollout_worker_0"][0], before["RayTrainWorker"][0]
        _kill_node_of(cluster, worker_node)
        _wait(proc, out, lambda: "rollout worker 0 restarted" in out.read_text(), "rollout worker 0 restarted")
        if rank_node != worker_node:  # the rank was elsewhere: its node goes next
            _kill_node_of(cluster, rank_node)
        nodes_killed = 1 + (rank_node != worker_node)
        _wait(proc, out, lambda: "a train worker died" in out.read_text(), "the rank's restart")
        after_restart = len(_iterations(run_dir))
        _wait(proc, out, lambda: len(_iterations(run_dir)) > after_restart, "an iteration after the restart")
        after = _actor_nodes(run)
    finally:
        code = _stop(proc)
    text = out.read_text()
    assert code == 130 and f"run {run} interrupted" in text, text[-3000:]  # stopped by Ctrl-C, not completed
    assert "restart 1 of 2" in text and "Training failed" not in text
    assert {name: after[name] for name in NAMES} == {name: (head, 0) for name in NAMES}  # never restarted
    restarted = [int(r["trainer/iteration"]) for r in live_records(run_dir) if r.get("trainer/restarts") == 1]
    assert restarted and restarted == list(range(restarted[0], restarted[0] + len(restarted)))
    first = [int(r["trainer/iteration"]) for r in live_records(run_dir) if r.get("trainer/restarts") == 0]
    assert 0 <= max(first) - (restarted[0] - 1) <= 1  # resumed from the latest checkpoint (save_interval 1)
    print(
        f"FIGURE {nodes_killed} node(s) killed: {len(restarted)} iterations after the rank's restart, "
        f"from iteration {restarted[0]}"
    )


def test_a_rank_that_fits_no_node_is_refused_before_training(cluster, tmp_path: Path) -> None:
    """4 CPUs in the cluster, a rank of 3: the sum fits, no node does. Refused before any actor starts."""
    run = "too-wide"
    proc, out = _driver(tmp_path, _config(tmp_path, run, use_ray_train=True, num_cpus_per_worker=3), cluster.address)
    end = time.monotonic() + 300
    try:
        # Watched while the driver runs: a run let through starts its logging actor at once, long before its
        # rank's wait for a node ends it another way.
        while proc.poll() is None:
            started = _run_actors(run)
            assert not started, f"the run started {started}: its rank fits no node, yet it was not refused first"
            assert time.monotonic() < end, "the driver neither refused the run nor ended within 300 s"
            time.sleep(0.2)  # polling the cluster's actor table
    finally:
        if proc.poll() is None:
            proc.kill()
    code = proc.returncode
    assert not _run_actors(run)
    text = out.read_text()
    assert code == 2, text[-3000:]
    assert f"a trainer rank needs {{CPU: 3}} on one node" in text and f"at {cluster.address}" in text, text[-3000:]
    assert "{CPU: 2}" in text and "Traceback" not in text
    assert not (tmp_path / "runs" / run / "metrics.jsonl").exists() or not _iterations(tmp_path / "runs" / run)


def test_an_actor_no_node_can_hold_is_named_after_the_bound(cluster) -> None:
    """An actor pending for resources no alive node has fails the run, named with its shape, once it has
    waited ``bound`` seconds: not within the bound, at the first look past it (the bound is lowered to
    0 rather than waited for)."""
    import ray

    from mineonline_core.driver.placement import PendingWatch
    from mineonline_core.errors import RunFailedError

    watch = PendingWatch(bound=3600.0, interval=0.0)
    big = ray.remote(num_cpus=3)(type("Wide", (), {})).options(name="wide").remote()
    try:
        end = time.monotonic() + 60
        while not any("wide" in what for _, what, _ in watch._pending()):
            assert time.monotonic() < end, "the actor never showed as pending"
            time.sleep(0.2)  # the GCS registers the actor asynchronously
        watch.check()  # seen, within the bound: nothing yet
        watch.bound = 0.0
        with pytest.raises(RunFailedError, match=r"actor wide .*\{CPU: 3\}.*no alive node"):
            watch.check()
    finally:
        ray.kill(big)


def test_an_actor_waiting_for_room_is_warned_about_and_one_waiting_to_start_is_not(
    cluster, caplog, monkeypatch
) -> None:
    """Past the bound, an actor whose resources some node has but every such node has taken gets the "full"
    warning; one whose resources a node has free (it only waits for its process to start, on a busy machine;
    Ray Train's controller needs no resources at all) does not."""
    import ray

    from mineonline_core.driver import placement

    filler = [ray.remote(num_cpus=2)(type("Filler", (), {"ping": lambda self: 1})).remote() for _ in range(2)]
    ray.get([f.ping.remote() for f in filler])  # both worker nodes full
    watch = placement.PendingWatch(bound=0.0, interval=0.0)
    waiting = ray.remote(num_cpus=2)(type("Waiting", (), {})).options(name="waiting").remote()
    try:
        end = time.monotonic() + 60
        while not any("waiting" in what for _, what, _ in watch._pending()):
            assert time.monotonic() < end, "the actor never showed as pending"
            time.sleep(0.2)  # the GCS registers the actor asynchronously
        assert not placement._room_now({"CPU": 2.0}) and placement._room_now({})
        with caplog.at_level("WARNING", logger="mineonline"):
            watch.check()
        assert any("actor waiting" in r.getMessage() and "are full" in r.getMessage() for r in caplog.records)
        caplog.clear()
        watch._warned.clear()
        monkeypatch.setattr(placement, "_room_now", lambda shape: True)  # as if a node had freed its CPUs
        with caplog.at_level("WARNING", logger="mineonline"):
            watch.check()
        assert not any("actor waiting" in r.getMessage() for r in caplog.records)
    finally:
        for actor in [*filler, waiting]:
            ray.kill(actor)


def test_losing_the_head_says_so_with_the_resume_command(tmp_path: Path) -> None:
    """The head dies (GCS, the driver's raylet and object store): Ray ends the driver from C++; the
    supervising CLI prints the cause and the resume command, writes it to run.log, exits 1, and leaves
    run.json and the checkpoints for ``--resume``. A cluster of its own: this one does not survive."""
    with _token_mode():
        cluster = start_cluster({"num_cpus": 0, "include_dashboard": False}, [{"num_cpus": 2}])
    run, run_dir, address = "lost-head", tmp_path / "runs" / "lost-head", cluster.address
    try:
        proc, out = _driver(tmp_path, _config(tmp_path, run), address)
        try:
            _wait(proc, out, lambda: max(_iterations(run_dir), default=0) >= 1, "iteration 1 (and its checkpoint)")
            cluster.remove_node(cluster.head_node, allow_graceful=False)
            code = proc.wait(timeout=300)
        finally:
            _stop(proc)
    finally:
        cluster.shutdown()
    text = out.read_text()
    assert code == 1, text[-3000:]
    last = [line for line in text.splitlines() if line.strip()][-1]
    assert last.startswith(f"error: lost the Ray cluster at {address}"), text[-3000:]
    assert f"mineonline run --resume {run_dir} --address {address}" in last
    assert f"lost the Ray cluster at {address}" in (run_dir / "run.log").read_text()
    assert (run_dir / "run.json").exists() and any((run_dir / "checkpoints").iterdir())


def test_a_rank_lost_with_its_node_counts_as_a_dead_rank() -> None:
    """What Ray Train 2.60's ``fit`` raises when a rank's node is SIGKILLed (seen in the cluster test above):
    a ``WorkerGroupError`` holding the health check's ``ActorUnavailableError`` (connection reset), which
    names no actor class. A dead rank; a health check that failed for another reason, or the training
    function's own error, is not."""
    from ray.exceptions import ActorUnavailableError, RaySystemError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2.api.exceptions import WorkerGroupError

    from mineonline_core.trainer.recovery import is_rank_death

    def group_error(failure: BaseException) -> WorkerGroupError:
        return WorkerGroupError("[Rank 0 Error Snippet]: ...", {0: failure})

    info = "A worker health check failed.\nWorker info: Worker(actor=Actor(RayTrainWorker, 87aa7d3f), ...)"
    unavailable = ActorUnavailableError(
        "The actor is temporarily unavailable: RpcError: RPC error: recvmsg:Connection reset by peer rpc_code: 14", None
    )
    assert is_rank_death(group_error(WorkerHealthCheckFailedError(info, failure=unavailable)))
    assert not is_rank_death(group_error(WorkerHealthCheckFailedError(info, failure=RaySystemError("cannot pickle"))))
    assert not is_rank_death(group_error(ValueError("the training function raised")))


def test_a_driver_that_died_without_a_word_is_explained(tmp_path: Path) -> None:
    """The supervising parent's message for a child driver that ended without noting its exit: the lost
    cluster when nothing answers at the address, the driver's own death when the cluster still answers,
    each with the resume command; a child that noted its exit keeps its status and prints nothing more."""
    import socket

    from mineonline_core.driver import supervise

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
            lost = supervise.abrupt_end_report(dead, 1, "/runs/a b")
        alive = supervise.abrupt_end_report(live, -9, "/runs/x")
    assert lost.startswith(f"lost the Ray cluster at {dead}") and "(exit status 1)" in lost
    assert lost.endswith(f"mineonline run --resume '/runs/a b' --address {dead}")
    assert (
        alive.startswith("the driver process ended abruptly (signal 9)")
        and f"--resume /runs/x --address {live}" in alive
    )
    code = supervise.supervised(["plugins"], dead)  # `mineonline plugins` notes its exit like any command
    assert code == 0


def test_a_failed_run_whose_cluster_is_gone_ends_with_the_lost_cluster() -> None:
    """The head's death can reach the driver's Python first, as its logging actor gone: the run fails
    through Python and notes its exit. When its run had started and the cluster no longer answers, the
    parent still ends with the lost cluster and the resume command; otherwise the child's status stands."""
    import socket

    from mineonline_core.driver import supervise

    started = ["run_dir /runs/a", "exit 2"]
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        live = f"127.0.0.1:{listening.getsockname()[1]}"
        assert supervise.ending(started, 2, live) == (2, None)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{closed.getsockname()[1]}"
            status, report = supervise.ending(started, 2, dead)
            assert supervise.ending(["exit 2"], 2, dead) == (2, None)  # never started: its own error stands
            assert supervise.ending(["run_dir /runs/a", "exit 0"], 0, dead) == (0, None)
    assert status == 1 and report is not None
    assert report.startswith(f"lost the Ray cluster at {dead}") and "the run failed with it (exit status 2)" in report
    assert report.endswith(f"mineonline run --resume /runs/a --address {dead}")
