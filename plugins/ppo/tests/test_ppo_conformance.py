"""PPOTrainer passes the core's trainer conformance suite."""

from __future__ import annotations

from mineonline_core.testing.trainer_conformance import TrainerConformance
from mineonline_ppo import PPOTrainer


class TestPPOConformance(TrainerConformance):
    trainer_cls = PPOTrainer
    # The KL reference and clipped value loss on, so that every term of the loss is exercised.
    trainer_options = {"kl_divergence_coef_rho": 0.1, "clip_vloss": True, "entropy_bonus_coef": 0.01}
