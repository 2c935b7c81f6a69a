"""MineStudio's own VPT policy class (``minestudio.models.vpt``, 1.1.6) is refused before Ray starts,
with the guarantees it breaks, which these tests also demonstrate on the real class."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mineonline_core.errors import ConfigError
from mineonline_core.contracts.policy import prepare_policy
from mineonline_core.testing.minecraft import import_minestudio_vpt

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(os.environ.get("MINEONLINE_VPT_FIXTURES") or ROOT.parent / "shared" / "fixtures") / "vpt_public"
pytestmark = pytest.mark.skipif(
    not (FIXTURE / "public.model").exists(), reason="the shared VPT fixture is not beside this checkout"
)


@pytest.fixture(scope="module")
def minestudio_vpt() -> torch.nn.Module:
    """MineStudio's own loader and class, on the small random VPT files in place of the released ones."""
    return (
        import_minestudio_vpt().load_vpt_policy(str(FIXTURE / "public.model"), str(FIXTURE / "public.weights")).eval()
    )


def test_the_real_class_breaks_the_guarantees_the_refusal_names(minestudio_vpt: torch.nn.Module) -> None:
    torch.manual_seed(0)
    image = torch.randint(0, 256, (1, 4, 128, 128, 3), dtype=torch.uint8)
    state = [s.clone() for s in minestudio_vpt.initial_state(1)]
    with torch.no_grad():
        no_firsts, _ = minestudio_vpt({"image": image}, state, context={"first": torch.zeros(1, 4, dtype=torch.bool)})
        a_first, _ = minestudio_vpt(
            {"image": image}, state, context={"first": torch.tensor([[False, False, True, False]])}
        )
    torch.testing.assert_close(no_firsts["vpred"], a_first["vpred"])  # an episode start changes nothing
    assert minestudio_vpt.initial_state(2)[0] is minestudio_vpt.initial_state(2)[0]  # one cached state, shared
    normalizer = minestudio_vpt.value_head.normalizer
    before = normalizer.running_mean.clone()
    minestudio_vpt.train()
    minestudio_vpt.value_head.normalize(torch.full((4, 1, 1), 3.0))  # normalising any values moves the statistics
    minestudio_vpt.eval()
    assert not torch.equal(before, normalizer.running_mean)


def test_prepare_policy_refuses_minestudio_policies(minestudio_vpt: torch.nn.Module) -> None:
    with pytest.raises(
        ConfigError,
        match=r"minestudio\.models\.vpt\.body\.VPTPolicy.*context\['first'\].*mineonline_vpt\.load_vpt_policy",
    ):
        prepare_policy(minestudio_vpt, use_normalized_vf=True)


def test_check_refuses_it_before_ray_starts(tmp_path: Path) -> None:
    config = tmp_path / "minestudio_policy.py"
    config.write_text(
        textwrap.dedent(f"""
        import functools

        from minestudio.simulator import MinecraftSim

        from mineonline_core.testing.minecraft import import_minestudio_vpt, with_fake_engine

        env_generator = with_fake_engine(functools.partial(MinecraftSim, obs_size=(128, 128), num_empty_frames=1))


        def policy_generator():
            model, weights = {str(FIXTURE / "public.model")!r}, {str(FIXTURE / "public.weights")!r}
            return import_minestudio_vpt().load_vpt_policy(model, weights)


        online_dict = {{"rollout_config": {{"replay_buffer_config": {{"database_config": {{"backend": "memory"}}}}}}}}
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "check", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr
    assert "a MineStudio policy class" in out.stderr and "policy_config: {name: vpt" in out.stderr
