"""An env that cannot start is reported with its own exception: by ``mineonline check`` and
``mineonline run`` before Ray starts (built, reset and stepped once in a subprocess), and by a rollout
worker after a few identical failures instead of at its warm-up timeout minutes later. The tests check
those events and their messages; how long they took is printed, never asserted (load decides it)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cloudpickle
import pytest
from minestudio.simulator import MinecraftSim
from minestudio.simulator.callbacks import MinecraftCallback

from mineonline_core.driver.envcheck import probe_env
from mineonline_core.contracts.envs import adapted
from mineonline_core.errors import ConfigError, RunFailedError
from mineonline_core.testing import kit as tk
from mineonline_core.testing.kit import cartpole
from mineonline_core.testing.minecraft import with_fake_engine

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its callbacks travel to env processes
BROKEN = textwrap.dedent('''
    """A MineStudio config whose simulator builds but cannot reset."""
    from minestudio.simulator import MinecraftSim
    from minestudio.simulator.callbacks import MinecraftCallback

    from mineonline_core.testing.minecraft import fake_engine


    class NoWorld(MinecraftCallback):
        def after_reset(self, sim, obs, info):
            raise RuntimeError("the world failed to load")


    def env_generator():
        with fake_engine():
            return MinecraftSim(obs_size=(128, 128), num_empty_frames=1, callbacks=[NoWorld()])


    online_dict = {
        "policy_config": {"name": "vpt", "hidsize": 32, "impala_chans": [8, 8, 8], "n_recurrence_layers": 1,
                          "attention_heads": 2, "attention_memory_size": 16, "timesteps": 8},
        "rollout_config": {"num_rollout_workers": 1, "worker_config": {"num_envs": 1, "batch_size": 1},
                           "replay_buffer_config": {"database_config": {"backend": "memory"}}},
        "logger_config": {"loggers": []},
    }
''')


class NoWorld(MinecraftCallback):
    def after_reset(self, sim, obs, info):
        raise RuntimeError("the world failed to load")


class HangsAtStep(MinecraftCallback):
    def before_step(self, sim, action):
        time.sleep(600)
        return action


def broken_sim(callback: MinecraftCallback) -> functools.partial:
    return with_fake_engine(
        functools.partial(MinecraftSim, obs_size=(128, 128), num_empty_frames=1, callbacks=[callback])
    )


def test_check_reports_the_envs_own_exception_in_seconds(tmp_path: Path) -> None:
    config = tmp_path / "broken_cow.py"
    config.write_text(BROKEN)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "check", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    assert "raised RuntimeError: the world failed to load while being reset" in out.stderr
    print(f"FIGURE mineonline check reported the env's exception in {elapsed:.1f}s")


def test_run_fails_before_ray_starts(tmp_path: Path) -> None:
    import ray

    from mineonline_core.driver.api import run

    config = tmp_path / "broken_cow.py"
    config.write_text(BROKEN)
    with pytest.raises(ConfigError, match="RuntimeError: the world failed to load while being reset"):
        run(str(config), [f"output_dir={tmp_path}"], progress=False)
    assert not ray.is_initialized()


def test_probe_reports_a_hang_with_its_stage() -> None:
    """The hang is injected at the step, the stage with a budget of its own: starting the process,
    unpickling, building and resetting share a budget that no load exhausts (on a loaded machine the
    unpickling alone outlasted a 2s one), and the message names the stage the env hung at."""
    with pytest.raises(ConfigError, match="not stepped within 2s"):
        probe_env(broken_sim(HangsAtStep()), startup_timeout=600.0, step_timeout=2.0)


def minecraft_without_engine(directory: str) -> MinecraftSim:
    os.environ["MINESTUDIO_DIR"] = directory  # set here: the env process, not the test, looks for the engine
    return MinecraftSim(obs_size=(128, 128), num_empty_frames=1)


def test_a_missing_minecraft_engine_is_named_not_a_bare_eof(tmp_path: Path) -> None:
    # The real MinecraftSim finds no engine under an empty MINESTUDIO_DIR and asks on stdin to download it.
    with pytest.raises(ConfigError, match=r"EOFError.*download its Minecraft engine.*minestudio\.simulator\.entry -y"):
        probe_env(functools.partial(minecraft_without_engine, str(tmp_path)), startup_timeout=60.0, step_timeout=10.0)


def test_probe_returns_the_adapted_spaces() -> None:
    observation_space, action_space = probe_env(cartpole, startup_timeout=60.0, step_timeout=10.0)
    assert set(observation_space.spaces) == {"obs"} and action_space.n == 2


def interrupted_cartpole() -> object:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the probe's process group while the env builds
    return cartpole()


def test_ctrl_c_belongs_to_the_driver_not_the_probe() -> None:
    """The probe child ignores SIGINT (the driver owns Ctrl-C and kills the probe on its way out): it
    neither reports a KeyboardInterrupt as the env's failure nor writes to a pipe nobody reads."""
    # As in a shell's foreground: a process started in the background inherits SIGINT ignored, and so
    # would the probe, with or without the fix.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        observation_space, _ = probe_env(interrupted_cartpole, startup_timeout=60.0, step_timeout=10.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert set(observation_space.spaces) == {"obs"}


def test_probe_child_is_quiet_when_the_driver_stopped_listening() -> None:
    from mineonline_core.driver.envcheck import _child
    from mineonline_core.rollout.envproc import default_context

    ctx = default_context()
    parent, child = ctx.Pipe(duplex=False)
    parent.close()  # the driver gave up (Ctrl-C, its own time limit) before the probe answered
    process = ctx.Process(target=_child, args=(child, cloudpickle.dumps(adapted(cartpole)), 0), daemon=True)
    process.start()
    child.close()
    process.join(timeout=60)
    assert process.exitcode == 0  # a BrokenPipeError traceback would exit 1 on the user's console


@pytest.mark.parametrize("env_processes", [True, False], ids=["subprocess", "inline"])
def test_worker_stops_with_the_envs_exception_not_a_warmup_timeout(env_processes: bool) -> None:
    from mineonline_core.testing.kit import mlp_policy

    policy = mlp_policy()  # never runs: no env ever starts
    collector = tk.collector(
        policy=policy,
        env_fns=[adapted(broken_sim(NoWorld()))] * 2,
        fragment_length=4,
        batch_size=1,
        env_processes=env_processes,
    )
    # The event is the message (the env's exception after 3 failures), not how fast it came: the warm-up
    # timeout is generous so that only a worker that waits for it, not load, fails the match.
    t0 = time.monotonic()
    with pytest.raises(
        RunFailedError, match="RuntimeError: the world failed to load while being built or reset, 3 times"
    ):
        collector.warmup(timeout=600.0)
    print(f"FIGURE worker stopped with the env's exception after {time.monotonic() - t0:.1f}s")
