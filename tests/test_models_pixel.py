"""The feed-forward pixel policies ``cnn`` (SB3's CnnPolicy) and ``impala_resnet`` (Moon et al. 2023):
the conformance suite, the architectures the papers describe, registration, and the Crafter examples."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch import nn

from mineonline_core.builtin.models import CNNPolicy, ImpalaResNetPolicy
from mineonline_core.config import load_config
from mineonline_core.errors import ConfigError
from mineonline_core.registry import PluginManager, get_plugin_manager
from mineonline_core.driver.resolve import resolve
from mineonline_core.testing.policy_conformance import PolicyConformance

ROOT = Path(__file__).resolve().parents[1]
CRAFTER_OBS = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
CRAFTER_ACTIONS = gym.spaces.Discrete(17)
SMALL_RESNET = {"channels": [4, 8], "blocks_per_stage": 1, "dense_sizes": [16, 24]}


class TestCNNPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)})
    action_space = gym.spaces.Discrete(5)

    def make_policy(self) -> CNNPolicy:
        config = CNNPolicy.Config(channels=[4, 8, 8], hidden_size=16)
        return CNNPolicy.build(config, observation_space=self.observation_space, action_space=self.action_space)


class TestImpalaResNetPolicy(PolicyConformance):
    observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (20, 20, 3), np.uint8)})
    action_space = gym.spaces.Discrete(5)

    def make_policy(self) -> ImpalaResNetPolicy:
        config = ImpalaResNetPolicy.Config(**SMALL_RESNET)
        return ImpalaResNetPolicy.build(
            config, observation_space=self.observation_space, action_space=self.action_space
        )


class TestImpalaResNetPolicyWithoutNorms(TestImpalaResNetPolicy):
    def make_policy(self) -> ImpalaResNetPolicy:
        config = ImpalaResNetPolicy.Config(**SMALL_RESNET, group_norm=False, layer_norm=False)
        return ImpalaResNetPolicy.build(
            config, observation_space=self.observation_space, action_space=self.action_space
        )


def _shapes(module: nn.Module, kind: type) -> list[tuple[int, ...]]:
    return [tuple(m.weight.shape) for m in module.modules() if isinstance(m, kind)]


def test_cnn_is_the_nature_cnn_with_a_512_unit_layer_on_crafter_images() -> None:
    policy = CNNPolicy.build(CNNPolicy.Config(), observation_space=CRAFTER_OBS, action_space=CRAFTER_ACTIONS)
    convs = [m for m in policy.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (3, 32, (8, 8), (4, 4)),
        (32, 64, (4, 4), (2, 2)),
        (64, 64, (3, 3), (1, 1)),
    ]
    # 64x64 -> 15x15 -> 6x6 -> 4x4 feature maps: 64 * 16 = 1024 inputs to the fully connected layer.
    assert _shapes(policy, nn.Linear) == [(512, 1024), (17, 512), (1, 512)]
    assert policy.initial_state(4) is None


def test_cnn_scales_pixels_to_the_unit_interval() -> None:
    torch.manual_seed(0)
    policy = CNNPolicy.build(
        CNNPolicy.Config(channels=[4, 8, 8], hidden_size=16),
        observation_space=CRAFTER_OBS,
        action_space=CRAFTER_ACTIONS,
    ).eval()
    image = torch.randint(0, 256, (2, 3, 64, 64, 3), dtype=torch.uint8)
    with torch.no_grad():
        latents, _ = policy({"image": image}, None, {"first": torch.zeros(2, 3, dtype=torch.bool)})
        pixels = image.reshape(6, 64, 64, 3).permute(0, 3, 1, 2).float() / 255.0
        expected = policy.pi_head(policy.embed(policy.cnn(pixels))).reshape(2, 3, 17)
    assert torch.allclose(latents["pi_logits"], expected, atol=1e-6)


def test_impala_resnet_default_is_moon_et_al_architecture() -> None:
    policy = ImpalaResNetPolicy.build(
        ImpalaResNetPolicy.Config(), observation_space=CRAFTER_OBS, action_space=CRAFTER_ACTIONS
    )
    convs = [m for m in policy.modules() if isinstance(m, nn.Conv2d)]
    # Three stages of one conv and two residual blocks of two convs, all 3x3.
    assert [c.out_channels for c in convs] == [64] * 5 + [128] * 10
    assert {c.kernel_size for c in convs} == {(3, 3)}
    assert sum(isinstance(m, nn.MaxPool2d) for m in policy.modules()) == 3
    # 64 -> 32 -> 16 -> 8: 128 * 8 * 8 inputs to the dense 256, then 1024, with a LayerNorm before each.
    assert _shapes(policy, nn.Linear) == [(256, 128 * 8 * 8), (1024, 256), (17, 1024), (1, 1024)]
    assert [m.normalized_shape for m in policy.modules() if isinstance(m, nn.LayerNorm)] == [(8192,), (256,)]
    # A one-group GroupNorm before every conv but the first stage's first, and after each pool.
    assert sum(isinstance(m, nn.GroupNorm) and m.num_groups == 1 for m in policy.modules()) == 14 + 3
    assert policy.value_head.normalizer.beta == 0.99


def test_impala_resnet_width_and_norms_are_configurable() -> None:
    config = ImpalaResNetPolicy.Config(channels=[16, 32, 32], group_norm=False, layer_norm=False, dense_sizes=[256])
    policy = ImpalaResNetPolicy.build(config, observation_space=CRAFTER_OBS, action_space=CRAFTER_ACTIONS)
    assert [m.out_channels for m in policy.modules() if isinstance(m, nn.Conv2d)] == [16] * 5 + [32] * 10
    assert not any(isinstance(m, (nn.GroupNorm, nn.LayerNorm)) for m in policy.modules())
    assert _shapes(policy, nn.Linear) == [(256, 32 * 8 * 8), (17, 256), (1, 256)]


def test_impala_resnet_init_keeps_the_residual_stream_near_unit_scale() -> None:
    # Without norms, unscaled residual branches would grow the activations with the depth.
    torch.manual_seed(0)
    config = ImpalaResNetPolicy.Config(channels=[16, 32, 32], blocks_per_stage=4, group_norm=False, layer_norm=False)
    policy = ImpalaResNetPolicy.build(config, observation_space=CRAFTER_OBS, action_space=CRAFTER_ACTIONS)
    with torch.no_grad():
        features = policy.encoder(torch.rand(8, 3, 64, 64))
    assert 0.1 < float(features.pow(2).mean().sqrt()) < 3.0


def test_pixel_policies_are_registered_and_built_from_policy_config() -> None:
    pm: PluginManager = get_plugin_manager()
    assert {"cnn", "impala_resnet"} <= set(pm.registries["policy"].names())
    assert pm.lookup("policy", "cnn") is CNNPolicy and pm.lookup("policy", "impala_resnet") is ImpalaResNetPolicy
    for name, options in (("cnn", {"hidden_size": 32}), ("impala_resnet", SMALL_RESNET)):
        config = {"env_config": {"name": "crafter", "length": 20}, "policy_config": {"name": name, **options}}
        policy = resolve(load_config(config), pm).policy_generator()
        assert type(policy) is pm.lookup("policy", name)
        assert policy.pi_head.linear.out_features == 17


@pytest.mark.parametrize("cls", [CNNPolicy, ImpalaResNetPolicy])
def test_pixel_policies_refuse_an_env_without_images(cls: type) -> None:
    vector = gym.spaces.Dict({"obs": gym.spaces.Box(-1.0, 1.0, (4,), np.float32)})
    with pytest.raises(ConfigError, match=rf"{cls.name!r} reads observation key 'image'.*Fix"):
        cls.build(cls.Config(), observation_space=vector, action_space=gym.spaces.Discrete(2))


def test_a_bad_width_is_refused_with_its_key() -> None:
    config = {
        "env_config": {"name": "crafter", "length": 20},
        "policy_config": {"name": "impala_resnet", "channels": [16, 0]},
    }
    with pytest.raises(ConfigError, match=r"policy_config\.channels"):
        resolve(load_config(config), get_plugin_manager())


@pytest.mark.parametrize("example", ["crafter.py", "crafter_ppo_resnet.py"])
def test_crafter_examples_pass_check(example: str) -> None:
    # What `mineonline check` does (minus the env subprocess): validate, resolve, probe the env, build the policy.
    resolved = resolve(load_config(str(ROOT / "examples" / example), []), get_plugin_manager())
    assert resolved.observation_space["image"].shape == (64, 64, 3)
    resolved.policy_generator()
