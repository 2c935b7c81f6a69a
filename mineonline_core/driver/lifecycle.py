"""``mineonline status`` and ``mineonline stop``: find and end runs from a second driver.

A run's actors live in the Ray namespace ``mineonline`` under names prefixed by the run name
(``{run}/rollout_manager``, ``{run}/logger_hub``, ...). With ``detach_rollout_manager`` they outlive
the driver that started them, so these commands attach to the cluster as a *second* driver.

Authentication: Ray 2.60 turns token authentication on for every cluster it starts, keeps the token
in ``~/.ray/auth_token`` (or ``RAY_AUTH_TOKEN_PATH``, or the ``RAY_AUTH_TOKEN`` variable) and a
connecting driver must present it. Ray only switches a client into token mode by itself when the
address is ``auto``; for an explicit ``host:port`` it stays in the default mode and the cluster
rejects it. So when a token is available and the user has not chosen a mode, we set
``RAY_AUTH_MODE=token`` before connecting. We never turn authentication off. A cluster that rejects
the token is found out by one RPC before ``ray.init`` (``check_token``): Ray's own client retries for
about 20 s, printing a C++ warning each second, and then reports that no cluster runs there.

Stopping never kills processes: it asks the run to stop (``request_stop``: the trainer writes a final
checkpoint and its driver tears the run down), waits a short grace period for that when the driver
that owns the run is still alive, then calls ``shutdown()`` on the manager and ``ray.kill`` on each
of the run's named actors.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mineonline_core.driver.rundir import RUN_FILE
from mineonline_core.errors import MineOnlineError
from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name, split_name

AUTH_MODE_VAR = "RAY_AUTH_MODE"


def token_available() -> bool:
    """Whether a Ray auth token is at hand: ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    candidate = Path(path).expanduser() if path else Path.home() / ".ray" / "auth_token"
    return candidate.is_file() and candidate.stat().st_size > 0


def prepare_auth_env() -> None:
    """Present the cluster's token when connecting: set ``RAY_AUTH_MODE=token`` if a token exists.

    An explicit ``RAY_AUTH_MODE`` chosen by the user is left as it is. Ray caches its config when
    ``ray`` is imported, so after changing the variable we ask it to re-read it (as Ray itself does
    in ``authentication_token_setup._enable_token_auth``).
    """
    if AUTH_MODE_VAR in os.environ or not token_available():
        return
    os.environ[AUTH_MODE_VAR] = "token"
    if "ray" in sys.modules:
        try:
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):  # a Ray without token auth: the variable is harmless
            pass


def token_source() -> str:
    """Where this driver's token comes from, as Ray reads it: the variable, the file it names, or the default file."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the RAY_AUTH_TOKEN environment variable"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return f"{path} (RAY_AUTH_TOKEN_PATH)"
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if token_available() else f"nowhere: no RAY_AUTH_TOKEN, no RAY_AUTH_TOKEN_PATH and no {default}"


def check_token(address: str, timeout: float = 10.0) -> None:
    """Ask the cluster at ``host:port`` for its id with this driver's token (one RPC, no retries) and
    raise ``MineOnlineError`` when it rejects the token. Any other answer, or none, is left to ``ray.init``."""
    try:
        import grpc
        from ray._raylet import AuthenticationTokenLoader
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # a Ray without token authentication
        return
    # Ray's loader caches the token for the process: read it fresh (the environment may have changed) and
    # leave no cache behind, or a local cluster started later here would be asked for this token.
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    try:
        metadata = tuple(loader.get_token_for_http_header().items()) if loader.has_token() else ()
    finally:
        loader.reset_cache()
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), metadata=metadata, timeout=timeout
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise MineOnlineError(
                    f"the cluster at {address} rejected this token (read from {token_source()}). Fix: give this driver "
                    "the token of the cluster's head node (its ~/.ray/auth_token): copy the file here, point "
                    "RAY_AUTH_TOKEN_PATH at it, or set RAY_AUTH_TOKEN."
                ) from None


def _listening(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (Ray waits minutes on a dead address)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise MineOnlineError(f"--address {address!r}: expected host:port of the Ray head node, or 'auto'.")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def attach(address: str) -> bool:
    """Connect to the running cluster at ``address`` ("auto" finds the local one); False when none runs."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return True
    target = address.removeprefix("ray://") if address != "auto" else address
    if target != "auto" and not _listening(target):
        return False  # checked before importing Ray: the import alone takes seconds
    prepare_auth_env()
    if target != "auto" and not address.startswith("ray://"):
        check_token(target)
    import ray

    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as exc:
        if "multiple" in str(exc).lower():
            raise MineOnlineError(f"--address {address}: {exc} Fix: pass --address host:port of the cluster.") from None
        return False
    except ray.exceptions.AuthenticationError as exc:
        raise MineOnlineError(
            f"--address {address}: the Ray cluster rejected this driver's token ({exc.message}). Fix: make the "
            "cluster's token available here, in ~/.ray/auth_token, via RAY_AUTH_TOKEN_PATH or as RAY_AUTH_TOKEN."
        ) from None
    except ValueError as exc:
        raise MineOnlineError(
            f"--address {address}: {exc}. Fix: give host:port of the Ray head node, or 'auto'."
        ) from None
    return True


def run_target(run: str | None, address: str | None) -> tuple[str | None, str]:
    """The run name and the cluster address ``status RUN`` and ``stop RUN`` mean. ``run``: a run name or
    a run directory (``runs/NAME`` is looked for too); a run directory names its run and, unless
    ``address`` is given, the cluster its ``run.json`` recorded, so that the command reaches that run's
    cluster and never another one that ``auto`` would pick. Otherwise ``address`` or ``auto``."""
    if run is not None:
        for path in (Path(run).expanduser(), Path("runs") / run):
            if (path / RUN_FILE).is_file():
                record = json.loads((path / RUN_FILE).read_text())
                recorded = record.get("ray_address")
                return str(record.get("run_name") or path.name), address or recorded or "auto"
    return run, address or "auto"


def list_runs() -> dict[str, list[str]]:
    """Run name -> names of its live named actors in namespace ``mineonline`` (sorted)."""
    import ray

    runs: dict[str, list[str]] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parts = split_name(entry["name"]) if entry["namespace"] == NAMESPACE else None
        if parts is not None:
            runs.setdefault(parts[0], []).append(entry["name"])
    return {run: sorted(names) for run, names in sorted(runs.items())}


def _manager_status(run: str, timeout: float = 10.0) -> dict[str, Any] | str:
    """The manager's ``status()``, or a short reason why it could not be read."""
    import ray

    try:
        manager = ray.get_actor(actor_name(run, ROLLOUT_MANAGER), namespace=NAMESPACE)
        return dict(ray.get(manager.status.remote(), timeout=timeout))
    except ValueError:
        return "no rollout manager"
    except ray.exceptions.GetTimeoutError:
        return f"rollout manager busy (no answer in {timeout:.0f}s)"
    except ray.exceptions.RayError as exc:
        return f"rollout manager unreachable ({type(exc).__name__})"


def _count(value: Any) -> Any:
    return len(value) if isinstance(value, (list, tuple, dict)) else value


def format_status(run: str, actors: list[str], status: dict[str, Any] | str) -> str:
    """One line per run: workers, buffer size, model version, env steps, then its actors."""
    if isinstance(status, str):
        head = status
    else:
        buffer = status.get("buffer_size", status.get("buffer"))
        if isinstance(buffer, dict):
            buffer = buffer.get("replay/chunks", buffer.get("chunks", buffer.get("size")))
        fields = {
            "workers": _count(status.get("workers")),
            "buffer": buffer,
            "version": status.get("version"),
            "env_steps": status.get("env_steps"),
        }
        head = "  ".join(f"{k}={v}" for k, v in fields.items() if v is not None) or "status: " + repr(status)
    short = ", ".join((split_name(name) or (run, name))[1] for name in actors)
    return f"{run}  {head}  actors: {short}"


def print_status(*, address: str = "auto", run: str | None = None) -> int:
    """Print the runs whose actors are alive (only ``run`` when given); 0 also when no cluster runs
    (with a message)."""
    if not attach(address):
        print(f"no Ray cluster is running at {address!r}: no mineonline runs are alive.")
        return 0
    runs = list_runs()
    if run is not None:
        runs = {run: runs[run]} if run in runs else {}
        if not runs:
            print(f"{run}: not alive on the cluster at {address!r}.")
            return 0
    if not runs:
        print("no mineonline runs are alive on this cluster.")
        return 0
    for run, actors in runs.items():
        print(format_status(run, actors, _manager_status(run)))
    return 0


def _owner_driver_alive(handle: Any) -> bool:
    """Whether the driver (job) that created the actor still runs: then it tears the run down itself."""
    import ray

    try:
        info = ray._private.state.actors(handle._actor_id.hex())
        job_hex = info.get("JobID")
        for job in ray._private.state.jobs():
            if job.get("JobID") == job_hex:
                return not job.get("IsDead", True)
    except Exception:  # noqa: BLE001 - best effort: without the answer we skip the grace period
        return False
    return False


def _wait_gone(names: list[str], timeout: float) -> bool:
    """Whether the run's actors are gone within ``timeout``. The actor list is read on a thread of its own:
    a GCS that goes away during that call (the run's driver ending the local cluster it had started, the
    success this waits for) keeps Ray's client waiting a minute and then ends this process with exit 1."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    gone, done = threading.Event(), threading.Event()

    def poll() -> None:
        while not done.is_set():
            alive = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE}
            if not alive.intersection(names):
                gone.set()
                return
            done.wait(0.5)  # polling a remote condition, not hiding a race

    threading.Thread(target=poll, name="mineonline-stop-poll", daemon=True).start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if gone.wait(0.5) or not _listening(gcs):
                return True
        return False
    finally:
        done.set()


def stop_run(run: str, actors: list[str], *, grace_s: float = 30.0) -> str:
    """Stop one run: request a graceful stop, wait for its driver up to ``grace_s``, then end the actors."""
    import ray

    manager, manager_name = None, actor_name(run, ROLLOUT_MANAGER)
    if manager_name in actors:
        manager = ray.get_actor(manager_name, namespace=NAMESPACE)
        try:
            ray.get(manager.request_stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a dead or busy manager is shut down below anyway
            pass
        if _owner_driver_alive(manager):
            print(f"{run}: asked to stop; waiting up to {grace_s:.0f}s for its driver to write a final checkpoint")
            if _wait_gone(actors, grace_s):
                return "stopped by its driver (final checkpoint written)"
        try:
            ray.get(manager.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - killed below
            pass
    for name in actors:
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass  # already gone
    return "stopped"


def stop_runs(run: str | None, *, address: str = "auto", grace_s: float = 30.0, every: bool = False) -> int:
    """Stop ``run``, or the only alive run, or every run with ``every``; 2 when no cluster runs or the
    run is unknown. Without a name and without ``every``, more than one alive run is refused (naming
    them): the cluster ``auto`` attaches to may be shared, and a stop cannot be undone."""
    if not attach(address):
        print(f"no Ray cluster is running at {address!r}: nothing to stop.", file=sys.stderr)
        return 2
    runs = list_runs()
    if run is not None:
        if run not in runs:
            alive = ", ".join(runs) or "none"
            raise MineOnlineError(
                f"mineonline stop {run}: no run of that name is alive (alive runs: {alive}). "
                "Fix: see `mineonline status`."
            )
        runs = {run: runs[run]}
    if not runs:
        print("no mineonline runs are alive on this cluster: nothing to stop.")
        return 0
    if run is None and not every and len(runs) > 1:
        raise MineOnlineError(
            f"mineonline stop: {len(runs)} runs are alive on this cluster ({', '.join(runs)}) and no run name was "
            f"given. Fix: name the one to stop (`mineonline stop {next(iter(runs))}`), or pass --all to stop every one."
        )
    for name, actors in runs.items():
        print(f"{name}: {stop_run(name, actors, grace_s=grace_s)}")
    return 0
