"""MineStudio compatibility without Minecraft: the cow example against a MinecraftSim stand-in.

This machine cannot run Minecraft, so `tests/standins/minestudio` mimics MinecraftSim's observation,
action and info structure; the real simulator is exercised only where MineStudio is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from mineonline_core.config import load_config
from mineonline_core.envs import MinecraftAdapter, adapt_env
from mineonline_core.errors import ConfigError
from mineonline_core.plugins import get_plugin_manager
from mineonline_core.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
STANDINS = Path(__file__).resolve().parent / "standins"
FIXTURE = ROOT.parent / "shared" / "fixtures" / "vpt_public"
COW = ROOT / "examples" / "minestudio_cow.py"


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(STANDINS))
    for name in [m for m in sys.modules if m.startswith("minestudio")]:
        monkeypatch.delitem(sys.modules, name)


def test_without_minestudio_the_error_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "minestudio", None)  # an import of it fails, as when not installed
    monkeypatch.setenv("VPT_MODEL", str(FIXTURE / "public.model"))
    with pytest.raises(ConfigError, match="pip install minestudio"):
        resolve(load_config(COW), get_plugin_manager())


def test_adapter_turns_minecraft_episode_end_into_truncation(standin: None) -> None:
    from minestudio.simulator import MinecraftSim

    env = adapt_env(MinecraftSim(obs_size=(128, 128), timestep_limit=3))
    assert isinstance(env, MinecraftAdapter)
    obs, info = env.reset()
    assert set(obs) == {"image"} and obs["image"].shape == (128, 128, 3) and obs["image"].dtype == np.uint8
    assert "pov" in info
    action = {"buttons": np.array([4]), "camera": np.array([60])}
    ends = [env.step(action)[2:4] for _ in range(3)]
    assert ends == [(False, False), (False, False), (False, True)]


@pytest.mark.skipif(not (FIXTURE / "public.model").exists(), reason="the shared VPT fixture is not beside this checkout")
def test_cow_example_resolves_and_collects_with_vpt(standin: None, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mineonline_vpt")
    from mineonline_core.rollout.collector import FragmentCollector
    from mineonline_core.envs import adapted

    monkeypatch.setenv("VPT_MODEL", str(FIXTURE / "public.model"))
    monkeypatch.setenv("VPT_WEIGHTS", str(FIXTURE / "public.weights"))
    loaded = load_config(COW, ["rollout_config.fragment_length=8", "train_config.context_length=8"])
    assert loaded.config.rollout_config.worker_config.num_envs == 12  # MineStudio's values, unchanged
    resolved = resolve(loaded, get_plugin_manager())
    policy = resolved.policy_generator()
    collector = FragmentCollector(policy=policy, env_fns=[adapted(resolved.env_generator)] * 2, fragment_length=8,
                                  batch_size=2, discount=0.999, step_timeout=60.0, max_env_restarts=3)  # fmt: skip
    try:
        fragments = collector.collect(2)
    finally:
        collector.close()
    for fragment in fragments:
        assert fragment["obs"]["image"].shape == (8, 128, 128, 3)
        assert fragment["action"]["buttons"].shape[0] == 8 and fragment["action"]["camera"].shape[0] == 8
        assert np.isfinite(fragment["logprob"]).all() and np.isfinite(fragment["vpred"]).all()
