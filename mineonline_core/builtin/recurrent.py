"""The recurrent core the built-in recurrent policies share (``cnn_gru``, ``mlp_gru``): a GRU cell
unrolled over time that resets at ``first``, and the policy shape around it (embed, GRU, both heads)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.policy import Policy, ValueHead


class ResettingGRU(nn.GRUCell):
    """The recurrent core of ``cnn_gru`` and ``mlp_gru``: a GRU cell unrolled over (B, T, D) inputs.

    The state is [(B, hidden_size)], zero at an episode start; ``first[:, t]`` zeroes it before step t,
    which is exactly ``initial_state``, so training over a fragment reproduces step-by-step rollout. A
    ``GRUCell`` subclass rather than a wrapper, so its parameters keep the ``gru.*`` names of earlier
    checkpoints."""

    def initial_state(self, batch_size: int) -> list[torch.Tensor]:
        return [torch.zeros(batch_size, self.hidden_size, device=self.weight_hh.device)]

    def unroll(
        self, x: torch.Tensor, state_in: list[torch.Tensor], first: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden state after every step (B, T, hidden_size), and the state after the last."""
        keep = (~first.bool()).to(x.dtype).unsqueeze(-1)  # (B, T, 1)
        h = state_in[0]
        outputs = []
        for step in range(x.shape[1]):
            h = self(x[:, step], h * keep[:, step])
            outputs.append(h)
        return torch.stack(outputs, 1), [h]


class RecurrentPolicy(Policy):
    """A feed-forward ``embed`` (B, T, ...) -> (B, T, D), then the ``ResettingGRU`` ``gru``, read by both heads."""

    gru: ResettingGRU
    pi_head: nn.Module  # the head of the env's action space
    value_head: ValueHead

    def embed_steps(self, input: dict) -> torch.Tensor:  # noqa: A002
        raise NotImplementedError

    def initial_state(self, batch_size: int) -> list[torch.Tensor]:
        return self.gru.initial_state(batch_size)

    def forward(self, input: dict, state_in: Any, context: dict) -> tuple[dict, Any]:  # noqa: A002
        latent, state_out = self.gru.unroll(self.embed_steps(input), state_in, context["first"])
        return {Outputs.PI_LOGITS: self.pi_head(latent), Outputs.VPRED: self.value_head(latent)}, state_out
