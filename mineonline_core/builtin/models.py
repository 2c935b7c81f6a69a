"""The core's default policies: an MLP for vector observations and a CNN with a GRU for images.

Both follow ``mineonline_core.contracts.policy``'s contract: inputs (B, T, ...), ``first`` (B, T) resets the
recurrent memory at any t, ``pi_logits`` are normalised log-probs and ``vpred`` is the normalised value.
"""

from __future__ import annotations

from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from mineonline_core.errors import ConfigError
from mineonline_core.contracts.policy import CategoricalHead, Policy, ValueHead


def _discrete_actions(action_space: gym.Space, policy: str) -> int:
    if isinstance(action_space, gym.spaces.Discrete):
        return int(action_space.n)
    raise ConfigError(
        f"policy_config.name: {policy!r} supports Discrete action spaces only, the env has {action_space}. "
        f"Fix: choose a policy whose head matches the env's actions (for Minecraft, 'vpt')."
    )


def _obs_space(observation_space: gym.Space, key: str, policy: str) -> gym.spaces.Box:
    if isinstance(observation_space, gym.spaces.Dict) and key in observation_space.spaces:
        return observation_space[key]
    raise ConfigError(
        f"policy_config.name: {policy!r} reads observation key {key!r}, the env observes {observation_space}. "
        f"Fix: use 'mlp' for vector observations ('obs') and 'cnn_gru' for images ('image')."
    )


def _mlp(width: int, sizes: list[int], activation: str) -> nn.Sequential:
    act = nn.Tanh if activation == "tanh" else nn.ReLU
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(width, size), act()]
        width = size
    return nn.Sequential(*layers)


class MLPPolicy(Policy):
    """A feed-forward MLP over ``{"obs": float32 (B, T, D)}`` with a categorical head."""

    name = "mlp"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        hidden_sizes: list[int] = Field([64, 64], description="Width of each hidden layer (shared torso).")
        activation: Literal["tanh", "relu"] = Field("tanh", description="Hidden activation.")
        value_normalizer_beta: float = Field(0.99999, gt=0, lt=1, description="EWMA decay of the value normaliser.")

    def __init__(self, *, obs_dim: int, num_actions: int, hidden_sizes: list[int], activation: str = "tanh",
                 value_normalizer_beta: float = 0.99999) -> None:  # fmt: skip
        super().__init__()
        # Separate actor and critic torsos, as in PPO's reference implementation for control tasks.
        self.actor = _mlp(obs_dim, hidden_sizes, activation)
        self.critic = _mlp(obs_dim, hidden_sizes, activation)
        width = hidden_sizes[-1] if hidden_sizes else obs_dim
        self.pi_head = CategoricalHead(width, num_actions)
        self.value_head = ValueHead(width, beta=value_normalizer_beta)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, np.sqrt(2))
                nn.init.zeros_(module.bias)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)

    @classmethod
    def build(cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space) -> "MLPPolicy":
        space = _obs_space(observation_space, "obs", cls.name)
        return cls(obs_dim=int(np.prod(space.shape)), num_actions=_discrete_actions(action_space, cls.name), **options.model_dump())

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        x = input["obs"].float().flatten(2)
        return {"pi_logits": self.pi_head(self.actor(x)), "vpred": self.value_head(self.critic(x))}, state_in


class RecurrentCNNPolicy(Policy):
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

    def __init__(self, *, image_shape: tuple[int, int, int], num_actions: int, channels: list[int],
                 hidden_size: int, value_normalizer_beta: float = 0.99999) -> None:  # fmt: skip
        super().__init__()
        h, w, c = image_shape
        c1, c2, c3 = channels
        self.cnn = nn.Sequential(
            nn.Conv2d(c, c1, 8, stride=4), nn.ReLU(),
            nn.Conv2d(c1, c2, 4, stride=2), nn.ReLU(),
            nn.Conv2d(c2, c3, 3, stride=1), nn.ReLU(),
            nn.Flatten(),
        )  # fmt: skip
        with torch.no_grad():
            flat = self.cnn(torch.zeros(1, c, h, w)).shape[1]
        self.embed = nn.Sequential(nn.Linear(flat, hidden_size), nn.ReLU())
        self.gru = nn.GRUCell(hidden_size, hidden_size)
        self.hidden_size = hidden_size
        self.pi_head = CategoricalHead(hidden_size, num_actions)
        self.value_head = ValueHead(hidden_size, beta=value_normalizer_beta)
        nn.init.orthogonal_(self.pi_head.linear.weight, 0.01)
        nn.init.zeros_(self.pi_head.linear.bias)

    @classmethod
    def build(cls, options: BaseModel, *, observation_space: gym.Space, action_space: gym.Space) -> "RecurrentCNNPolicy":
        space = _obs_space(observation_space, "image", cls.name)
        return cls(image_shape=tuple(space.shape), num_actions=_discrete_actions(action_space, cls.name), **options.model_dump())

    def initial_state(self, batch_size: int) -> list[torch.Tensor]:
        return [torch.zeros(batch_size, self.hidden_size, device=self.gru.weight_hh.device)]

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        image = input["image"]
        b, t = image.shape[:2]
        x = image.reshape(b * t, *image.shape[2:]).permute(0, 3, 1, 2).float().div_(255.0)
        x = self.embed(self.cnn(x)).reshape(b, t, -1)
        keep = (~context["first"].bool()).to(x.dtype).unsqueeze(-1)  # (B, T, 1)
        h = state_in[0]
        outputs = []
        for step in range(t):
            h = self.gru(x[:, step], h * keep[:, step])
            outputs.append(h)
        latent = torch.stack(outputs, 1)
        return {"pi_logits": self.pi_head(latent), "vpred": self.value_head(latent)}, [h]
