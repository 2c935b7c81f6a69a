"""VTraceTrainer passes the core's trainer conformance suite."""

from __future__ import annotations

from mineonline_core.testing.trainer_conformance import TrainerConformance
from mineonline_vtrace import VTraceTrainer


class TestVTraceConformance(TrainerConformance):
    trainer_cls = VTraceTrainer
    trainer_options = {"rho_bar": 2.0, "c_bar": 0.9, "vf_coef": 0.5, "entropy_bonus_coef": 0.01}
