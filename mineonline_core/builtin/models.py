"""The core's default policies: an MLP and an MLP with a GRU for vector observations; for images a
feed-forward CNN, a CNN with a GRU, and an IMPALA-ResNet.

All follow ``mineonline_core.contracts.policy``'s contract: inputs (B, T, ...), ``first`` (B, T) resets the
recurrent memory at any t, ``pi_logits`` are what the action head reads (``_action_head``: log-probs for
discrete actions, a Gaussian's mean and log-std for a ``Box``) and ``vpred`` is the normalised value.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from torch import nn

from mineonline_core.errors import ConfigError
from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.policy import CategoricalHead, GaussianHead, MultiCategoricalHead, Policy, ValueHead
from mineonline_core.builtin.recurrent import RecurrentPolicy, ResettingGRU


def _action_head(action_space: gym.Space, width: int, policy: str) -> nn.Module:
    """The head for the env's actions: a categorical (Discrete), one per dimension (MultiDiscrete), or a diagonal
    Gaussian with a state-independent log-std (a 1-D float Box; the env gets its samples clipped to the bounds)."""
    space = action_space
    # A Discrete or MultiDiscrete space that starts above 0 would get its actions shifted by the start.
    if isinstance(space, gym.spaces.Discrete) and int(space.start) == 0:
        return CategoricalHead(width, int(space.n))
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1 and not np.any(space.start):
        return MultiCategoricalHead(width, space.nvec.tolist())
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 1 and np.issubdtype(space.dtype, np.floating):
        return GaussianHead(width, space.shape[0])
    raise ConfigError(
        f"policy_config.name: {policy!r} supports Discrete and MultiDiscrete (1-D) starting at 0, and 1-D float Box "
        f"action spaces, the env has {space}. Fix: map the env's actions to one of these (a gymnasium ActionWrapper), "
        f"or choose a policy whose head matches them (for Minecraft, 'vpt')."
    )


def _obs_space(observation_space: gym.Space, key: str, policy: str) -> gym.spaces.Box:
    if isinstance(observation_space, gym.spaces.Dict) and key in observation_space.spaces:
        return observation_space[key]
    raise ConfigError(
        f"policy_config.name: {policy!r} reads observation key {key!r}, the env observes {observation_space}. "
        f"Fix: use 'mlp' or 'mlp_gru' for vector observations ('obs') and 'cnn', 'cnn_gru' or 'impala_resnet' for images ('image')."
    )


def _mlp(width: int, sizes: list[int], activation: str) -> nn.Sequential:
    act = nn.Tanh if activation == "tanh" else nn.ReLU
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(width, size), act()]
        width = size
    return nn.Sequential(*layers)


class MLPPolicy(Policy):
    """A feed-forward MLP over ``{"obs": float32 (B, T, D)}`` with the head of its action space (``_action_head``)."""

    name = "mlp"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        hidden_sizes: list[int] = Field([64, 64], description="Width of each hidden layer (shared torso).")
        activation: Literal["tanh", "relu"] = Field("tanh", description="Hidden activation.")
        value_normalizer_beta: float = Field(0.99999, gt=0, lt=1, description="EWMA decay of the value normaliser.")

    def __init__(
        self,
        *,
        obs_dim: int,
        num_actions: int | None = None,
        hidden_sizes: list[int],
        activation: str = "tanh",
        value_normalizer_beta: float = 0.99999,
        action_space: gym.Space | None = None,
    ) -> None:
        super().__init__()
        # Separate actor and critic torsos, as in PPO's reference implementation for control tasks.
        self.actor = _mlp(obs_dim, hidden_sizes, activation)
        self.critic = _mlp(obs_dim, hidden_sizes, activation)
        width = hidden_sizes[-1] if hidden_sizes else obs_dim
        space = gym.spaces.Discrete(num_actions) if action_space is None else action_space
        self.pi_head = _action_head(space, width, self.name)
        self.value_head = ValueHead(width, beta=value_normalizer_beta)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, np.sqrt(2))
                nn.init.zeros_(module.bias)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)

    @classmethod
    def build(cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space) -> "MLPPolicy":
        space = _obs_space(observation_space, "obs", cls.name)
        return cls(obs_dim=int(np.prod(space.shape)), action_space=action_space, **options.model_dump())

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = input["obs"].float().flatten(2)
        return {
            Outputs.PI_LOGITS: self.pi_head(self.actor(x)),
            Outputs.VPRED: self.value_head(self.critic(x)),
        }, state_in


def _images(input: dict) -> tuple[torch.Tensor, int, int]:  # noqa: A002
    """``input["image"]`` uint8 (B, T, H, W, C) as float (B*T, C, H, W) in [0, 1], and B, T."""
    image = input["image"]
    b, t = image.shape[:2]
    return image.reshape(b * t, *image.shape[2:]).permute(0, 3, 1, 2).float().div_(255.0), b, t


def _nature_cnn(in_channels: int, channels: list[int]) -> nn.Sequential:
    """The convolutional torso of Mnih et al. (2015): 8x8/4, 4x4/2, 3x3/1, each followed by a ReLU."""
    c1, c2, c3 = channels
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, 8, stride=4),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 4, stride=2),
        nn.ReLU(),
        nn.Conv2d(c2, c3, 3, stride=1),
        nn.ReLU(),
        nn.Flatten(),
    )


def _flat_size(module: nn.Module, image_shape: tuple[int, int, int]) -> int:
    h, w, c = image_shape
    with torch.no_grad():
        return int(module(torch.zeros(1, c, h, w)).shape[1])


class _FeedForwardImagePolicy(Policy):
    """A policy without memory over ``{"image": uint8 (B, T, H, W, 3)}``: a subclass's ``torso`` maps
    (B*T, 3, H, W) floats to features, which the policy and value heads read."""

    pi_head: nn.Module
    value_head: ValueHead

    def torso(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def build(cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space) -> Policy:
        space = _obs_space(observation_space, "image", cls.name)
        return cls(image_shape=tuple(space.shape), action_space=action_space, **options.model_dump())

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x, b, t = _images(input)
        latent = self.torso(x).reshape(b, t, -1)
        return {Outputs.PI_LOGITS: self.pi_head(latent), Outputs.VPRED: self.value_head(latent)}, state_in


class CNNPolicy(_FeedForwardImagePolicy):
    """A feed-forward Nature CNN (Mnih et al. 2015) and a fully connected layer over
    ``{"image": uint8 (B, T, H, W, C)}``, shared by the policy and value heads: Stable-Baselines3's
    ``CnnPolicy``. No memory: ``initial_state`` is None and ``first`` is not read."""

    name = "cnn"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        channels: list[PositiveInt] = Field(
            [32, 64, 64],
            min_length=3,
            max_length=3,
            description="Channels of the three conv layers (8x8 stride 4, 4x4 stride 2, 3x3 stride 1).",
        )
        hidden_size: int = Field(512, ge=1, description="Width of the fully connected layer after the convs.")
        value_normalizer_beta: float = Field(0.99999, gt=0, lt=1, description="EWMA decay of the value normaliser.")

    def __init__(
        self,
        *,
        image_shape: tuple[int, int, int],
        num_actions: int | None = None,
        channels: list[int],
        hidden_size: int,
        value_normalizer_beta: float = 0.99999,
        action_space: gym.Space | None = None,
    ) -> None:
        super().__init__()
        self.cnn = _nature_cnn(image_shape[2], channels)
        self.embed = nn.Sequential(nn.Linear(_flat_size(self.cnn, image_shape), hidden_size), nn.ReLU())
        space = gym.spaces.Discrete(num_actions) if action_space is None else action_space
        self.pi_head = _action_head(space, hidden_size, self.name)
        self.value_head = ValueHead(hidden_size, beta=value_normalizer_beta)
        # SB3's initialisation: orthogonal, gain sqrt(2) in the torso, 0.01 for the policy, 1 for the value.
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.orthogonal_(module.weight, np.sqrt(2))
                nn.init.zeros_(module.bias)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)
        nn.init.orthogonal_(self.value_head.linear.weight, 1.0)

    def torso(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.cnn(x))


class RecurrentCNNPolicy(RecurrentPolicy):
    """A CNN torso (Nature-DQN style) and a GRU core over ``{"image": uint8 (B, T, H, W, 3)}``.

    The GRU state is (B, hidden_size), zero at an episode start; ``first[:, t]`` zeroes it before step t,
    which is exactly ``initial_state``, so training over a fragment reproduces step-by-step rollout.
    """

    name = "cnn_gru"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        channels: list[int] = Field([32, 64, 64], min_length=3, max_length=3, description="Conv channels.")
        hidden_size: int = Field(256, ge=8, description="Width of the embedding and of the GRU state.")
        value_normalizer_beta: float = Field(0.99999, gt=0, lt=1, description="EWMA decay of the value normaliser.")

    def __init__(
        self,
        *,
        image_shape: tuple[int, int, int],
        num_actions: int | None = None,
        channels: list[int],
        hidden_size: int,
        value_normalizer_beta: float = 0.99999,
        action_space: gym.Space | None = None,
    ) -> None:
        super().__init__()
        self.cnn = _nature_cnn(image_shape[2], channels)
        self.embed = nn.Sequential(nn.Linear(_flat_size(self.cnn, image_shape), hidden_size), nn.ReLU())
        self.gru = ResettingGRU(hidden_size, hidden_size)
        self.hidden_size = hidden_size
        space = gym.spaces.Discrete(num_actions) if action_space is None else action_space
        self.pi_head = _action_head(space, hidden_size, self.name)
        self.value_head = ValueHead(hidden_size, beta=value_normalizer_beta)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)
        nn.init.zeros_(self.pi_head.linear.bias)

    @classmethod
    def build(
        cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space
    ) -> "RecurrentCNNPolicy":
        space = _obs_space(observation_space, "image", cls.name)
        return cls(
            image_shape=tuple(space.shape),
            action_space=action_space,
            **options.model_dump(),
        )

    def embed_steps(self, input: dict) -> torch.Tensor:  # noqa: A002
        x, b, t = _images(input)
        return self.embed(self.cnn(x)).reshape(b, t, -1)


class RecurrentMLPPolicy(RecurrentPolicy):
    """An MLP torso and a GRU core over ``{"obs": float32 (B, T, D)}``, shared by the policy and value
    heads (the head of its action space, ``_action_head``): the role of SB3-contrib's ``RecurrentPPO``
    ``MlpLstmPolicy`` (a GRU, one core for both heads).

    The GRU state is (B, hidden_size), zero at an episode start; ``first[:, t]`` zeroes it before step t.
    """

    name = "mlp_gru"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        hidden_sizes: list[int] = Field([64], description="Width of each hidden layer of the MLP before the GRU.")
        activation: Literal["tanh", "relu"] = Field("tanh", description="Hidden activation of the MLP.")
        hidden_size: int = Field(64, ge=1, description="Width of the GRU state, which both heads read.")
        value_normalizer_beta: float = Field(0.99999, gt=0, lt=1, description="EWMA decay of the value normaliser.")

    def __init__(
        self,
        *,
        obs_dim: int,
        num_actions: int | None = None,
        hidden_sizes: list[int],
        hidden_size: int,
        activation: str = "tanh",
        value_normalizer_beta: float = 0.99999,
        action_space: gym.Space | None = None,
    ) -> None:
        super().__init__()
        self.embed = _mlp(obs_dim, hidden_sizes, activation)
        self.gru = ResettingGRU(hidden_sizes[-1] if hidden_sizes else obs_dim, hidden_size)
        self.hidden_size = hidden_size
        space = gym.spaces.Discrete(num_actions) if action_space is None else action_space
        self.pi_head = _action_head(space, hidden_size, self.name)
        self.value_head = ValueHead(hidden_size, beta=value_normalizer_beta)
        for module in self.embed.modules():
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, np.sqrt(2))
                nn.init.zeros_(module.bias)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)
        nn.init.zeros_(self.pi_head.linear.bias)

    @classmethod
    def build(
        cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space
    ) -> "RecurrentMLPPolicy":
        space = _obs_space(observation_space, "obs", cls.name)
        return cls(obs_dim=int(np.prod(space.shape)), action_space=action_space, **options.model_dump())

    def embed_steps(self, input: dict) -> torch.Tensor:  # noqa: A002
        return self.embed(input["obs"].float().flatten(2))


def _fan_in_init(layer: nn.Conv2d | nn.Linear, scale: float) -> None:
    """Scale each output unit's incoming weights to L2 norm ``scale`` and zero the bias (VPT's init)."""
    with torch.no_grad():
        weight = layer.weight
        weight.mul_(scale / weight.flatten(1).norm(dim=1).clamp(min=1e-12).view(-1, *[1] * (weight.dim() - 1)))
        if layer.bias is not None:
            layer.bias.zero_()


class _NormConvReLU(nn.Sequential):
    """[GroupNorm with one group] -> conv 3x3 (no bias after a norm) -> ReLU."""

    def __init__(self, in_channels: int, out_channels: int, *, norm: bool, scale: float) -> None:
        conv = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=not norm)
        _fan_in_init(conv, scale)
        super().__init__(*([nn.GroupNorm(1, in_channels)] if norm else []), conv, nn.ReLU())


class _ResidualBlock(nn.Module):
    def __init__(self, channels: int, *, norm: bool, scale: float) -> None:
        super().__init__()
        self.branch = nn.Sequential(
            _NormConvReLU(channels, channels, norm=norm, scale=scale),
            _NormConvReLU(channels, channels, norm=norm, scale=scale),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


class ImpalaResNetPolicy(_FeedForwardImagePolicy):
    """The IMPALA-ResNet encoder (Espeholt et al. 2018) as Moon et al. (NeurIPS 2023) configure it for
    Crafter, over ``{"image": uint8 (B, T, H, W, C)}``; feed-forward, heads shared.

    Each stage: conv 3x3 -> max-pool 3x3 stride 2 -> residual blocks of two 3x3 convs. With
    ``group_norm`` a one-group GroupNorm normalises the input of every conv but the first stage's,
    and each pooled output. Then dense layers (``layer_norm``: a LayerNorm on each one's input), ReLU
    after every layer. Weights use fan-in normalised init, the residual branches scaled down with the
    depth so that the residual stream's scale stays near its input's at initialisation.
    """

    name = "impala_resnet"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        channels: list[PositiveInt] = Field(
            [64, 128, 128],
            min_length=1,
            description="Output channels of each stage; each stage halves the resolution "
            "(Moon et al.: 64/128/128; 16/32/32 costs ~1/16 of the FLOPs).",
        )
        blocks_per_stage: int = Field(2, ge=0, description="Residual blocks (two 3x3 convs each) per stage.")
        group_norm: bool = Field(True, description="One-group GroupNorm before the convs and after each pool.")
        dense_sizes: list[PositiveInt] = Field(
            [256, 1024],
            min_length=1,
            description="Widths of the dense layers after the stages; the heads read the last.",
        )
        layer_norm: bool = Field(True, description="LayerNorm on the input of each dense layer.")
        value_normalizer_beta: float = Field(
            0.99, gt=0, lt=1, description="EWMA decay of the value normaliser (Moon et al.: 0.99)."
        )

    def __init__(
        self,
        *,
        image_shape: tuple[int, int, int],
        num_actions: int | None = None,
        channels: list[int],
        blocks_per_stage: int,
        group_norm: bool,
        dense_sizes: list[int],
        layer_norm: bool,
        value_normalizer_beta: float = 0.99,
        action_space: gym.Space | None = None,
    ) -> None:
        super().__init__()
        stages: list[nn.Module] = []
        in_channels = image_shape[2]
        # Scale of each residual-branch conv, so that the sum of all branches has about unit scale.
        branch_scale = (len(channels) * max(blocks_per_stage, 1)) ** -0.25
        for i, out_channels in enumerate(channels):
            stages += [
                _NormConvReLU(in_channels, out_channels, norm=group_norm and i > 0, scale=1.0),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
            if group_norm:
                stages.append(nn.GroupNorm(1, out_channels))
            stages += [
                _ResidualBlock(out_channels, norm=group_norm, scale=branch_scale) for _ in range(blocks_per_stage)
            ]
            in_channels = out_channels
        self.encoder = nn.Sequential(*stages, nn.Flatten())
        dense: list[nn.Module] = []
        width = _flat_size(self.encoder, image_shape)
        for i, size in enumerate(dense_sizes):
            linear = nn.Linear(width, size, bias=not layer_norm)
            _fan_in_init(linear, 1.4 if i == 0 else 1.0)
            dense += [*([nn.LayerNorm(width)] if layer_norm else []), linear, nn.ReLU()]
            width = size
        self.dense = nn.Sequential(*dense)
        space = gym.spaces.Discrete(num_actions) if action_space is None else action_space
        self.pi_head = _action_head(space, width, self.name)
        self.value_head = ValueHead(width, beta=value_normalizer_beta)
        # Near-uniform initial actions; small initial values (Moon et al.'s gains).
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)
        nn.init.zeros_(self.pi_head.linear.bias)
        nn.init.orthogonal_(self.value_head.linear.weight, 0.1)
        nn.init.zeros_(self.value_head.linear.bias)

    def torso(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.encoder(x))
