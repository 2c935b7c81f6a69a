"""Action heads: one categorical distribution per key of a dict action (VPT's buttons and camera).

``pi_logits`` are normalised log-probabilities (``log_softmax(linear(latent) / temperature)``). A key
declared with a singleton axis has log-probs (B, T, 1, n) and actions (B, T, 1), VPT's layout;
otherwise (B, T, n) and (B, T).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F

from mineonline_vpt.actions import N_BUTTONS, N_CAMERA


class CategoricalLinear(nn.Module):
    """A linear layer to the logits of one categorical (parameter names match VPT's heads)."""

    def __init__(self, in_features: int, n: int, *, init_gain: float = 0.01) -> None:
        super().__init__()
        self.n = n
        self.linear_layer = nn.Linear(in_features, n)
        # Small initial logits: a freshly built policy starts close to uniform.
        nn.init.orthogonal_(self.linear_layer.weight, gain=init_gain)
        nn.init.zeros_(self.linear_layer.bias)


class DictActionHead(nn.Module):
    """Independent categoricals, one per key; joint log-prob, entropy and KL are sums over keys."""

    def __init__(
        self,
        in_features: int,
        sizes: Mapping[str, int],
        *,
        temperature: float = 1.0,
        singleton: bool | Mapping[str, bool] = True,
    ) -> None:
        super().__init__()
        for key, n in sizes.items():
            self.add_module(key, CategoricalLinear(in_features, int(n)))
        self.keys = list(sizes)
        self.temperature = float(temperature)
        self.singleton = {k: singleton if isinstance(singleton, bool) else bool(singleton[k]) for k in sizes}

    def forward(self, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for key in self.keys:
            head: CategoricalLinear = getattr(self, key)
            logits = head.linear_layer(latent) / self.temperature
            if self.singleton[key]:
                logits = logits.unsqueeze(-2)
            out[key] = F.log_softmax(logits, dim=-1)
        return out

    def _per_key(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """Sum the singleton axis away: (B, T, 1) -> (B, T)."""
        return values.sum(-1) if self.singleton[key] else values

    def sample(self, pi_logits: Mapping[str, torch.Tensor], deterministic: bool = False) -> dict[str, torch.Tensor]:
        """Argmax, or a Gumbel-max sample, per key."""
        out = {}
        for key in self.keys:
            logp = pi_logits[key]
            if not deterministic:
                u = torch.rand_like(logp).clamp_(1e-20, 1.0 - 1e-7)
                logp = logp - torch.log(-torch.log(u))
            out[key] = logp.argmax(-1)
        return out

    def logprob(self, action: Mapping[str, torch.Tensor], pi_logits: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Joint log-prob (B, T); every key's term counts (VPT keeps the camera term always)."""
        total = 0
        for key in self.keys:
            logp = pi_logits[key]
            a = torch.as_tensor(action[key], device=logp.device).long()
            total = total + self._per_key(key, logp.gather(-1, a.unsqueeze(-1)).squeeze(-1))
        return total

    def entropy(self, pi_logits: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sum(self._per_key(k, -(pi_logits[k].exp() * pi_logits[k]).sum(-1)) for k in self.keys)

    def kl_divergence(self, logits_q: Mapping[str, torch.Tensor], logits_p: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """KL(q || p), summed over keys, (B, T)."""
        return sum(self._per_key(k, (logits_q[k].exp() * (logits_q[k] - logits_p[k])).sum(-1)) for k in self.keys)

    def entropy_per_key(self, pi_logits: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self._per_key(k, -(pi_logits[k].exp() * pi_logits[k]).sum(-1)) for k in self.keys}


def minecraft_head(in_features: int, *, temperature: float = 1.0) -> DictActionHead:
    """VPT's joint Minecraft head: camera (121) then buttons (8641), each with a singleton axis."""
    return DictActionHead(in_features, {"camera": N_CAMERA, "buttons": N_BUTTONS}, temperature=temperature)
