"""Generalised advantage estimation (Schulman et al. 2016, eq. 11-16) over chunks (N, L).

Termination and truncation are kept apart: GAE bootstraps through a time limit or an env crash and stops
at a true terminal.

* ``terminated[t]``: a true terminal state; nothing is bootstrapped and the recursion stops.
* ``truncated[t]``: the episode was cut (time limit, env crash or hang); the TD target bootstraps
  from the stored ``bootstrap[t]`` (the value of the observation the episode was cut at) and the
  recursion restarts, because step ``t + 1`` belongs to a new episode.
* otherwise the next value is ``value[t + 1]``, or ``next_value`` after the chunk's last step.

A chunk is ``fragments_per_chunk`` consecutive fragments of one env already concatenated along time,
so chaining fragments needs nothing more than running the recursion over the whole length.

Why the truncation bootstrap is the *behaviour* value while every other value is recomputed with the
current model: recomputing it needs the final observation and the recurrent state reached at that
step. The state exists only inside the trainer's windowed forward, and the observation would be an
extra full observation per truncation in every fragment (Minecraft frames dominate a fragment's
size). The mismatch is confined to one step per truncated episode, its size is bounded by how far
the value function moved in at most ``max_staleness`` versions, and ``bootstrap`` is stored
denormalised, so a change of the value normaliser does not shift it. It is the same approximation
PPO makes with the behaviour ``vpred`` it clips the value loss around.
"""

from __future__ import annotations

import torch


def compute_gae(
    *,
    reward: torch.Tensor,
    value: torch.Tensor,
    next_value: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    bootstrap: torch.Tensor,
    discount: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and lambda-returns, both (N, L) float32.

    ``reward``, ``value`` (denormalised), ``bootstrap`` are float (N, L); ``terminated`` and
    ``truncated`` bool (N, L); ``next_value`` (N,) is the value of the observation after the last step.
    """
    reward, value, bootstrap = reward.float(), value.float(), bootstrap.float()
    terminated, truncated = terminated.bool(), truncated.bool()
    n, length = reward.shape
    # The value of the state each step leads to: the next step's value inside an episode, the
    # stored bootstrap at a truncation, zero at a termination.
    following = torch.cat([value[:, 1:], next_value.float().reshape(n, 1)], dim=1)
    following = torch.where(truncated, bootstrap, following)
    following = torch.where(terminated, torch.zeros_like(following), following)
    delta = reward + discount * following - value
    # Carry the recursion only into steps of the same episode.
    carry = (~(terminated | truncated)).float() * (discount * gae_lambda)
    advantage = torch.zeros_like(reward)
    running = torch.zeros(n, dtype=reward.dtype, device=reward.device)
    for t in range(length - 1, -1, -1):
        running = delta[:, t] + carry[:, t] * running
        advantage[:, t] = running
    return advantage, advantage + value
