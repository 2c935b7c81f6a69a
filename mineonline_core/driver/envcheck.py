"""Build, reset and step the env once in a subprocess, as a rollout worker will, before Ray starts.

``mineonline run`` and ``mineonline check`` call ``probe_env``: an env that raises while being built,
reset or stepped, or hangs, is reported at once with its own exception (type, message, traceback)
instead of surfacing minutes later as a worker's warm-up timeout. The probe goes through the same
pickling, process start and ``apply_command`` protocol as ``EnvProcess``, so what passes here starts
in a worker, and the env's spaces come back for the policy generator.
"""

from __future__ import annotations

import signal
import time
import traceback
from multiprocessing import connection
from typing import Any, Callable

from mineonline_core.errors import ConfigError, MineOnlineError, last_line


def _child(conn: connection.Connection, env_fn_bytes: bytes, seed: int) -> None:
    import cloudpickle

    from mineonline_core.rollout.envproc import apply_command

    # Ctrl-C reaches the whole process group: the driver owns it and kills this probe on its way out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stage = "unpickled"
    try:
        env_fn = cloudpickle.loads(env_fn_bytes)
        conn.send(("stage", stage := "built"))
        env = env_fn()
        conn.send(("stage", stage := "reset"))
        check_observation(env.observation_space, apply_command(env, "reset", seed, ())[0], "reset")
        conn.send(("stage", stage := "stepped"))
        check_observation(env.observation_space, apply_command(env, "step", env.action_space.sample(), ())[0], "step")
        spaces = cloudpickle.dumps((env.observation_space, env.action_space))
        env.close()
        answer: tuple = ("ok", spaces)
    except MineOnlineError as exc:  # the env factory's own message for the user (a bad env_config, say)
        answer = ("user", stage, str(exc))
    except BaseException:  # noqa: BLE001 - whatever the env raised is the answer
        answer = ("error", stage, traceback.format_exc())
    try:
        conn.send(answer)
    except OSError:  # the driver stopped waiting (Ctrl-C, its own time limit): nobody is left to tell
        pass


def observation_mismatches(space: Any, obs: Any, path: str = "") -> list[str]:
    """Where ``obs`` has another shape than ``space`` declares (Box leaves, through Dict spaces)."""
    import gymnasium as gym
    import numpy as np

    if isinstance(space, gym.spaces.Dict) and isinstance(obs, dict):
        return [
            m
            for key, sub in space.spaces.items()
            if key in obs
            for m in observation_mismatches(sub, obs[key], f"{path}.{key}" if path else str(key))
        ]
    if isinstance(space, gym.spaces.Box) and tuple(np.shape(obs)) != tuple(space.shape):
        return [f"{path or 'the observation'} has shape {tuple(np.shape(obs))}, the space says {tuple(space.shape)}"]
    return []


def check_observation(space: Any, obs: Any, after: str) -> None:
    """A policy is built from the observation space: an env whose observations break it would fail
    later inside the policy's first matmul, naming neither the env nor the key."""
    wrong = observation_mismatches(space, obs)
    if wrong:
        raise ConfigError(
            f"env_generator: the observation after {after} does not match the env's observation_space: "
            f"{'; '.join(wrong)}. A policy built from the space would fail on it. Fix the env's "
            f"observation_space (or the observation it returns) so the two agree."
        )


# MineStudio's MinecraftSim asks on stdin whether to download its engine when the engine is missing; an env
# process has no stdin, so the question surfaces as a bare EOFError unless it is explained.
_STDIN_HINT = (
    " The env read standard input, which its process does not have: MineStudio's MinecraftSim asks there "
    "whether to download its Minecraft engine when the engine is missing. Fix: download the engine once "
    "beforehand (python -m minestudio.simulator.entry -y, or set MINESTUDIO_DIR to where it is), or make "
    "the env take its answer from its config."
)


def probe_env(
    env_generator: Callable[[], Any],
    *,
    startup_timeout: float,
    step_timeout: float,
    seed: int = 0,
    meanwhile: Callable[[], Any] | None = None,
) -> tuple[Any, Any]:
    """The adapted env's ``(observation_space, action_space)``; raises ``ConfigError`` naming the env's
    own exception when building, resetting or stepping it fails, or when a stage outlasts its limit.
    ``meanwhile`` runs here while the subprocess starts and probes (the two use different cores)."""
    import cloudpickle

    from mineonline_core.contracts.envs import adapted
    from mineonline_core.rollout.envproc import default_context

    ctx = default_context()
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(child, cloudpickle.dumps(adapted(env_generator)), seed), daemon=True)
    process.start()
    child.close()
    if meanwhile is not None:
        meanwhile()
    stage, limit = "unpickled", startup_timeout
    deadline = time.monotonic() + limit
    try:
        while True:
            if not parent.poll(max(0.0, deadline - time.monotonic())):
                raise ConfigError(
                    f"env_generator: the env was not {stage} within {limit:.0f}s in a test subprocess (pid "
                    f"{process.pid}); a rollout worker would declare it hung. Fix the env, or raise "
                    f"rollout_config.worker_config.step_timeout if it is merely slow."
                )
            try:
                message = parent.recv()
            except EOFError:
                process.join(timeout=5.0)
                raise ConfigError(
                    f"env_generator: the env's process died (exit code {process.exitcode}) before the env was "
                    f"{stage}; a crash in native code (the simulator) is the usual cause."
                ) from None
            if message[0] == "stage":
                stage = message[1]
                if stage == "stepped":
                    limit = step_timeout
                    deadline = time.monotonic() + limit
            elif message[0] == "user":
                raise ConfigError(message[2])
            elif message[0] == "error":
                _, failed, trace = message
                hint = (
                    (
                        " Env factories are pickled into a fresh process: define env_generator in an importable module "
                        "or a Python config file."
                    )
                    if failed == "unpickled"
                    else ""
                )
                if last_line(trace).startswith("EOFError"):
                    hint += _STDIN_HINT
                raise ConfigError(
                    f"env_generator: the env raised {last_line(trace)} while being {failed} in a subprocess, as a "
                    f"rollout worker would build, reset and step it. Every env would fail the same way.{hint}\n{trace}"
                )
            else:
                return cloudpickle.loads(message[1])
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=5.0)
        parent.close()
