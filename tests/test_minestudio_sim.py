"""MineStudio's real ``MinecraftSim`` (minestudio 1.1.6, installed by ``make install`` from
requirements-minestudio.txt) on ``mineonline_core.testing.minecraft``'s fake engine: only the Java
game is replaced; MinecraftSim's reset/step, callbacks, action mapping and resize are MineStudio's.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from minestudio.simulator import MinecraftSim
from minestudio.simulator.callbacks import CommandsCallback, JudgeResetCallback, RewardsCallback, SummonMobsCallback

from mineonline_core.config import load_config
from mineonline_core.contracts.envs import MinecraftAdapter, adapt_env, adapted
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager
from mineonline_core.driver.resolve import resolve
from mineonline_core.testing import kit as tk
from mineonline_core.rollout.envproc import EnvProcess, InlineEnv
from mineonline_core.testing.minecraft import with_fake_engine
from mineonline_core.contracts.tree import tree_map

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(os.environ.get("MINEONLINE_VPT_FIXTURES") or ROOT.parent / "shared" / "fixtures") / "vpt_public"
COW = ROOT / "examples" / "minestudio_cow.py"
ATTACK = {"buttons": np.array([4]), "camera": np.array([60])}  # VPT's joint code for "attack" alone


def sim_factory(time_limit: int = 3, **kwargs) -> functools.partial:
    """A picklable MinecraftSim factory on the fake engine (a partial of MineStudio's own class)."""
    callbacks = [JudgeResetCallback(time_limit), *kwargs.pop("callbacks", [])]
    return with_fake_engine(
        functools.partial(MinecraftSim, obs_size=(128, 128), num_empty_frames=2, callbacks=callbacks, **kwargs)
    )


def small_vpt(env) -> torch.nn.Module:
    from mineonline_vpt import VPTPolicy

    options = {
        "hidsize": 32,
        "impala_chans": [8, 8, 8],
        "n_recurrence_layers": 1,
        "attention_heads": 2,
        "attention_memory_size": 16,
        "timesteps": 8,
    }
    return VPTPolicy.build(options, observation_space=env.observation_space, action_space=env.action_space)


def test_the_real_reset_takes_no_argument_and_the_adapter_passes_none() -> None:
    assert list(inspect.signature(MinecraftSim.reset).parameters) == ["self"]  # MineStudio 1.1.6's signature
    env = adapt_env(sim_factory(time_limit=3)())
    assert isinstance(env, MinecraftAdapter)
    obs, info = env.reset(seed=5)  # the call that crashed every env with TypeError
    assert set(obs) == {"image"} and obs["image"].shape == (128, 128, 3) and obs["image"].dtype == np.uint8
    assert info["pov"].shape == (360, 640, 3) and "location_stats" in info and info["health"] == 20.0
    # JudgeResetCallback's time limit sets `terminated` alone; Minecraft has no terminal state: a truncation.
    ends = [env.step(dict(ATTACK))[2:4] for _ in range(3)]
    assert ends == [(False, False), (False, False), (False, True)]


@pytest.mark.parametrize("handle", [EnvProcess, InlineEnv], ids=["subprocess", "inline"])
def test_env_handles_reset_and_step_the_real_sim_with_a_seed(handle) -> None:
    proc = handle(adapted(sim_factory(time_limit=2)))
    try:
        proc.send_reset(7)
        obs, *_ = proc.recv()
        assert obs["image"].shape == (128, 128, 3)
        for expected in (False, True):
            proc.send_step(dict(ATTACK))
            _, reward, terminated, truncated, info, final_obs = proc.recv()
            assert (terminated, truncated) == (False, expected) and (final_obs is not None) == expected
    finally:
        proc.close()


def test_cow_example_callbacks_drive_the_engine() -> None:
    loaded = load_config(COW)
    env = adapt_env(with_fake_engine(loaded.env_generator)())
    engine = env.unwrapped.env
    env.reset()
    summons = [c for c in engine.commands if "summon minecraft:cow" in c]
    assert len(summons) == 10 and "/give @p minecraft:iron_sword 1" in engine.commands and engine.resets == 1
    env.reset()  # FastResetCallback: commands instead of a new world
    assert engine.resets == 1 and "/kill @e[type=!player]" in engine.commands and len(engine.commands) == 2 * 13 + 6


def test_kill_entity_rewards_and_achievements() -> None:
    cow_ahead = SummonMobsCallback([{"name": "cow", "number": 1, "range_x": [0, 0], "range_z": [2, 2]}])
    reward = RewardsCallback(
        [{"event": "kill_entity", "objects": ["cow"], "reward": 1.0, "identity": "kill_cow", "max_reward_times": 5}]
    )
    sword = CommandsCallback(["/give @p minecraft:iron_sword 1"])
    env = adapt_env(sim_factory(time_limit=3, callbacks=[cow_ahead, sword, reward])())
    env.reset()
    steps = [env.step(dict(ATTACK)) for _ in range(3)]  # two sword hits kill a cow (10 health)
    assert [s[1] for s in steps] == [0.0, 1.0, 0.0]
    assert steps[-1][3] and steps[-1][4]["achievements"] == {"kill_entity/cow": 1}
    env.reset()  # counts are per episode although MineRL's statistics accumulate
    assert env.step(dict(ATTACK))[4].get("achievements") is None


@pytest.mark.parametrize("env_processes", [True, False], ids=["subprocess", "inline"])
def test_stored_actions_are_the_sampled_codes(env_processes: bool) -> None:
    """MinecraftSim.step pops ``buttons``/``camera`` from the dict it is given and adds env keys; what a
    fragment stores must still be the codes the policy sampled, not a decoded and re-encoded action."""
    make = sim_factory(time_limit=5)
    sim = make()
    policy = small_vpt(adapt_env(sim))
    sampled = []
    sample = policy.pi_head.sample

    def spy(logits, **kwargs):
        action = sample(logits, **kwargs)
        sampled.append(tree_map(lambda a: a[0, 0].clone().numpy(), action))  # row 0: the one env's action
        return action

    policy.pi_head.sample = spy
    collector = tk.collector(
        policy=policy,
        env_fns=[adapted(make)],
        fragment_length=6,
        batch_size=1,
        env_processes=env_processes,
        step_timeout=60.0,
    )
    try:
        fragments = collector.collect(2)
    finally:
        collector.close()
    stored = {key: np.concatenate([f["action"][key] for f in fragments]) for key in ("buttons", "camera")}
    for key in stored:
        np.testing.assert_array_equal(stored[key], np.stack([s[key] for s in sampled[:12]]))

    # The check has teeth: some of these codes come back different from MineStudio's own round trip.
    def round_trip(t: int) -> tuple[int, int]:
        env_action = sim.agent_action_to_env_action({k: stored[k][t] for k in stored})
        agent = sim.env_action_to_agent_action({k: np.asarray(v)[None] for k, v in env_action.items()})
        return int(np.ravel(agent["buttons"])[0]), int(np.ravel(agent["camera"])[0])

    codes = [(int(stored["buttons"][t][0]), int(stored["camera"][t][0])) for t in range(12)]
    assert any(round_trip(t) != codes[t] for t in range(12))


def test_without_minestudio_the_error_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m.startswith("minestudio")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "minestudio", None)  # an import of it fails, as when not installed
    monkeypatch.setenv("VPT_MODEL", str(FIXTURE / "public.model"))
    with pytest.raises(ConfigError, match="pip install minestudio"):
        resolve(load_config(COW), get_plugin_manager())


@pytest.mark.skipif(
    not (FIXTURE / "public.model").exists(), reason="the shared VPT fixture is not beside this checkout"
)
def test_cow_example_resolves_and_collects_with_vpt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VPT_MODEL", str(FIXTURE / "public.model"))
    monkeypatch.setenv("VPT_WEIGHTS", str(FIXTURE / "public.weights"))
    loaded = load_config(COW, ["rollout_config.fragment_length=8", "train_config.context_length=8"])
    assert loaded.config.rollout_config.worker_config.num_envs == 12  # MineStudio's values, unchanged
    loaded.env_generator = with_fake_engine(loaded.env_generator)
    resolved = resolve(loaded, get_plugin_manager())
    collector = tk.collector(
        policy=resolved.policy_generator(),
        env_fns=[adapted(resolved.env_generator)] * 2,
        fragment_length=8,
        batch_size=2,
        discount=0.999,
        step_timeout=60.0,
        max_env_restarts=3,
    )
    try:
        fragments = collector.collect(2)
    finally:
        collector.close()
    for fragment in fragments:
        assert fragment["obs"]["image"].shape == (8, 128, 128, 3)
        assert fragment["action"]["buttons"].shape[0] == 8 and fragment["action"]["camera"].shape[0] == 8
        assert np.isfinite(fragment["logprob"]).all() and np.isfinite(fragment["vpred"]).all()
