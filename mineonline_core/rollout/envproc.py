"""One env in its own subprocess, stepped asynchronously, observations through shared memory
(``EnvProcess``), or the same protocol in the caller's thread for very cheap envs (``InlineEnv``).

Why a subprocess per env: simulators (Minecraft above all) hang, leak and crash; a process can be
killed by its pid and rebuilt without touching the rollout worker or its other envs. Why not plain
``fork``: the Ray worker that owns the envs runs threads, and forking a threaded process can
deadlock; we use ``forkserver`` (cheap starts after the first) or ``spawn``.

Protocol (parent → child over a pipe): ``("reset", seed)``, ``("step", action)``,
``("attach", (shm_name, layout))``, ``("close", None)``. The child answers every command with
``(status, obs_or_None, reward, terminated, truncated, info, final_obs)``. The first observation
travels pickled; the parent then allocates one shared-memory block sized from it and tells the
child to write later observations there, so a step moves only a few scalars through the pipe.
When an episode ends the child resets at once (one round trip instead of two): the final
observation travels pickled (episode ends are rare) and the reset observation goes to shared memory.
If that reset raises, the answer is ``("reset_error", traceback, reward, terminated, truncated, info,
final_obs)``: the step itself happened, and its reward, end flag and final observation must survive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import traceback
from multiprocessing import connection, shared_memory
from typing import Any, Callable

import numpy as np

from mineonline_core.contracts.envs import clip_action
from mineonline_core.contracts.tree import tree_leaves, tree_map

_ALIGN = 64
# ``info`` keys that travel back to the parent: the rest of ``info`` is dropped in the child so
# that a step does not pickle a simulator's whole debug dictionary.
DEFAULT_INFO_KEYS = ("task", "achievements")


class EnvFailure(Exception):
    """The env raised, hung or its process died: ``kind`` is "error", "timeout" or "died"; "fatal"
    when the env factory cannot even be unpickled in the env process (rebuilding cannot help)."""

    def __init__(self, kind: str, detail: str, step: tuple | None = None) -> None:
        super().__init__(f"env {kind}: {detail}")
        self.kind, self.detail = kind, detail
        # The step that ended the episode when only the reset after it failed:
        # ``(reward, terminated, truncated, info, final_obs)``.
        self.step = step


class ResetFailed(Exception):
    """The reset after an episode-ending step raised; ``step`` is that step's answer."""

    def __init__(self, step: tuple) -> None:
        super().__init__("the reset after an episode end failed")
        self.step = step


def default_context() -> mp.context.BaseContext:
    """``forkserver`` where available (Linux), else ``spawn``; never plain fork (see module doc)."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Preloading this module in the server makes every later env process start in
        # milliseconds: the fork inherits numpy and the protocol code already imported.
        ctx.set_forkserver_preload(["__main__", __name__])
        return ctx
    return mp.get_context("spawn")


def start_server() -> None:
    """Start the forkserver now, in the background: its interpreter and preloads (about a second)
    then overlap with whatever the caller does before its first env process (building a policy)."""
    if default_context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


# ---------------------------------------------------------------------------------------------
# Shared-memory layout of one observation tree
# ---------------------------------------------------------------------------------------------


def obs_layout(obs: Any) -> list[tuple[tuple[int, ...], str, int]] | None:
    """``[(shape, dtype, offset)]`` per leaf, or None when a leaf is not a numeric array."""
    layout, offset = [], 0
    for leaf in tree_leaves(obs):
        arr = np.asarray(leaf)
        if arr.dtype.kind not in "biuf":
            return None
        layout.append((tuple(arr.shape), arr.dtype.str, offset))
        offset += (arr.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return layout


def layout_nbytes(layout: list[tuple[tuple[int, ...], str, int]]) -> int:
    shape, dtype, offset = layout[-1]
    return max(offset + int(np.prod(shape)) * np.dtype(dtype).itemsize, 1)


def _views(buf: memoryview, layout: list[tuple[tuple[int, ...], str, int]]) -> list[np.ndarray]:
    return [np.ndarray(shape, dtype=np.dtype(dtype), buffer=buf, offset=off) for shape, dtype, off in layout]


def _matches(leaves: list[Any], views: list[np.ndarray]) -> bool:
    if len(leaves) != len(views):
        return False
    return all(np.shape(x) == v.shape and np.asarray(x).dtype == v.dtype for x, v in zip(leaves, views))


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a hung env never outlives it."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def apply_command(env: Any, cmd: str, data: Any, info_keys: tuple[str, ...]) -> tuple:
    """Run ``step`` (the action clipped to a ``Box`` space's bounds, ``clip_action``; resetting at once when the
    episode ends) or ``reset`` on ``env``; returns
    ``(obs, reward, terminated, truncated, info, final_obs)``, with ``info`` cut to ``info_keys``."""

    def keep(info: dict) -> dict:
        return {k: info[k] for k in info_keys if k in info}

    if cmd == "reset":
        obs, info = env.reset(seed=data)
        return obs, None, False, False, {"reset_info": keep(info)}, None
    # Only an array action can need clipping: MinecraftSim builds its (dict) action space anew at every access.
    action = clip_action(data, env.action_space) if isinstance(data, np.ndarray) else data
    obs, reward, terminated, truncated, info = env.step(action)
    final_obs, info = None, keep(info)
    if terminated or truncated:
        final_obs = obs
        try:
            obs, reset_info = env.reset()
        except Exception as exc:
            raise ResetFailed((float(reward), bool(terminated), bool(truncated), info, final_obs)) from exc
        info = {**info, "reset_info": keep(reset_info)}
    return obs, float(reward), bool(terminated), bool(truncated), info, final_obs


def _child_main(conn: connection.Connection, env_fn_bytes: bytes, info_keys: tuple[str, ...]) -> None:
    import cloudpickle

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    shm, views = None, None

    def pack(obs: Any) -> Any:
        # Into shared memory when the layout matches, else pickled through the pipe.
        if views is not None:
            leaves = tree_leaves(obs)
            if _matches(leaves, views):
                for view, leaf in zip(views, leaves):
                    view[...] = leaf
                return None
        return obs

    try:
        env_fn = cloudpickle.loads(env_fn_bytes)
    except BaseException:  # noqa: BLE001 - deterministic: rebuilding cannot help
        conn.send(("fatal", traceback.format_exc(), None, None, None, None, None))
        return
    try:
        env = env_fn()
    except BaseException:  # noqa: BLE001 - reported to the parent, which rebuilds
        conn.send(("error", traceback.format_exc(), None, None, None, None, None))
        return
    while True:
        try:
            cmd, data = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if cmd in ("step", "reset"):
                obs, *rest = apply_command(env, cmd, data, info_keys)
                conn.send(("ok", pack(obs), *rest))
            elif cmd == "attach":
                name, layout = data
                shm = shared_memory.SharedMemory(name=name)
                views = _views(shm.buf, layout)
                conn.send(("ok", None, None, False, False, {}, None))
            elif cmd == "close":
                break
        except ResetFailed as failed:
            conn.send(("reset_error", traceback.format_exc(), *failed.step))
        except BaseException:  # noqa: BLE001 - any env failure is reported, then the parent rebuilds
            conn.send(("error", traceback.format_exc(), None, None, None, None, None))
    views = None
    try:
        env.close()
    finally:
        if shm is not None:
            shm.close()


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


class EnvProcess:
    """Parent-side handle of one env subprocess. Not thread-safe: one owner steps it.

    Commands are sent with ``send_*`` and answered by ``recv``; ``conn`` can be waited on with
    ``multiprocessing.connection.wait`` together with other envs' pipes, which is how the
    env pool (``envpool.py``) steps many envs asynchronously.
    """

    def __init__(
        self,
        env_fn: Callable[[], Any],
        *,
        ctx: mp.context.BaseContext | None = None,
        info_keys: tuple[str, ...] = DEFAULT_INFO_KEYS,
    ) -> None:
        import cloudpickle

        ctx = ctx or default_context()
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_child_main, args=(child_conn, cloudpickle.dumps(env_fn), tuple(info_keys)), daemon=True
        )
        self.process.start()
        child_conn.close()
        self._shm: shared_memory.SharedMemory | None = None
        self._views: list[np.ndarray] | None = None
        self._template: Any = None
        self._no_shm = False
        self._unlinked = False
        self.pending: str | None = None  # the command awaiting its answer

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send_reset(self, seed: int | None = None) -> None:
        self._send("reset", seed)

    def send_step(self, action: Any) -> None:
        self._send("step", action)

    def _send(self, cmd: str, data: Any) -> None:
        assert self.pending is None, f"env command {cmd!r} sent while {self.pending!r} is pending"
        try:
            self.conn.send((cmd, data))
        except (OSError, ValueError) as exc:
            raise EnvFailure("died", f"pipe closed ({exc}); exit code {self.process.exitcode}") from exc
        self.pending = cmd

    def poll(self) -> bool:
        return self.conn.poll()

    def recv(self) -> tuple[Any, float | None, bool, bool, dict, Any]:
        """The answer to the pending command: ``(obs, reward, terminated, truncated, info, final_obs)``.

        ``obs`` is a fresh copy (the shared block is overwritten by the next step). Raises
        ``EnvFailure`` when the env raised or its process died.
        """
        try:
            status, obs, reward, terminated, truncated, info, final_obs = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(timeout=1.0)
            raise EnvFailure("died", f"env process {self.pid} exited with code {self.process.exitcode}") from exc
        finally:
            self.pending = None
        if status in ("error", "fatal"):
            raise EnvFailure(status, obs)
        if status == "reset_error":
            raise EnvFailure("error", obs, step=(reward, terminated, truncated, info, final_obs))
        if obs is None:
            it = iter(self._views)
            obs = tree_map(lambda _: next(it).copy(), self._template)
        elif self._shm is None and not self._no_shm:
            self._attach(obs)
        return obs, reward, terminated, truncated, info, final_obs

    def _attach(self, obs: Any, timeout: float = 30.0) -> None:
        """Size a shared block from the first observation and hand it to the (idle) child."""
        layout = obs_layout(obs)
        if not layout:
            self._no_shm = True  # non-numeric leaves: keep pickling, correct if slower
            return
        self._shm = shared_memory.SharedMemory(create=True, size=layout_nbytes(layout))
        self._views = _views(self._shm.buf, layout)
        self._template = obs
        self._send("attach", (self._shm.name, layout))
        if not self.conn.poll(timeout):
            raise EnvFailure("timeout", f"env process {self.pid} did not attach shared memory in {timeout:.0f}s")
        self.recv()
        # Both processes have it mapped: drop the name now, so that the block cannot outlive them
        # even when both are SIGKILLed (Ray kills worker process trees without running cleanup).
        self._shm.unlink()
        self._unlinked = True

    def kill(self) -> None:
        """SIGKILL the env's process (by the pid we started) and free the shared block."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self._release()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the env to close; kill it when it does not exit within ``timeout``."""
        if self.process.is_alive() and self.pending is None:
            try:
                self.conn.send(("close", None))
            except (OSError, ValueError):
                pass
            self.process.join(timeout=timeout)
        self.kill()

    def _release(self) -> None:
        self._views = None
        try:
            self.conn.close()
        except OSError:
            pass
        if self._shm is not None:
            shm, self._shm = self._shm, None
            try:
                shm.close()
            except BufferError:
                pass  # a view still exported: the block is freed when that view goes away
            if not self._unlinked:  # attach never completed
                try:
                    shm.unlink()
                except FileNotFoundError:
                    pass

    def __del__(self) -> None:
        if (
            getattr(self, "process", None) is not None
            and self.process.pid is not None
            and os.getpid() == self.process._parent_pid
        ):
            try:
                self.kill()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class InlineEnv:
    """``EnvProcess``'s protocol, run in the caller's thread (``worker_config.env_processes: false``).

    For envs whose step costs microseconds (CartPole), where a pipe round trip and two context
    switches per step cost more than the env. The command runs inside ``send_*``, so the answer is
    ready before ``recv`` and there is no pipe to wait on. An exception is answered as an ``EnvFailure``
    and the env is rebuilt as usual, but a hang cannot be interrupted and a crash of native code takes
    the worker with it (Ray then restarts the worker).
    """

    def __init__(self, env_fn: Callable[[], Any], *, info_keys: tuple[str, ...] = DEFAULT_INFO_KEYS) -> None:
        self._env_fn, self._info_keys = env_fn, tuple(info_keys)
        self._env: Any = None
        self._answer: Any = None
        self.pending: str | None = None

    def send_reset(self, seed: int | None = None) -> None:
        self._run("reset", seed)

    def send_step(self, action: Any) -> None:
        self._run("step", action)

    def _run(self, cmd: str, data: Any) -> None:
        assert self.pending is None, f"env command {cmd!r} sent while {self.pending!r} is pending"
        self.pending = cmd
        try:
            if self._env is None:
                self._env = self._env_fn()
            obs, reward, terminated, truncated, info, final_obs = apply_command(self._env, cmd, data, self._info_keys)
            # An env may reuse its observation arrays; the pool and collector keep them past the next step.
            final_obs = None if final_obs is None else tree_map(np.array, final_obs)
            self._answer = (tree_map(np.array, obs), reward, terminated, truncated, info, final_obs)
        except ResetFailed as failed:
            reward, terminated, truncated, info, final_obs = failed.step
            step = (reward, terminated, truncated, info, tree_map(np.array, final_obs))
            self._answer = EnvFailure("error", traceback.format_exc(), step=step)
        except Exception:  # noqa: BLE001 - answered as a failure; the env pool rebuilds the env
            self._answer = EnvFailure("error", traceback.format_exc())

    def recv(self) -> tuple[Any, float | None, bool, bool, dict, Any]:
        answer, self._answer, self.pending = self._answer, None, None
        if isinstance(answer, EnvFailure):
            raise answer
        return answer

    def kill(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - a failed env's close may fail too; it is dropped either way
                pass

    def close(self, timeout: float = 5.0) -> None:
        self.kill()
