"""Issue 35 item 11: "did you mean" suggests a name a typo away, never one that merely shares a long part."""

from __future__ import annotations

import pytest

from mineonline_core.errors import UnknownComponentError, closest
from mineonline_core.registry import get_plugin_manager

TRAINERS = ["PPOTrainer", "A2CTrainer", "VTraceTrainer"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("SACTrainer", None),  # shares "Trainer" with every trainer, and SAC is none of them
        ("DQNTrainer", None),
        ("PP0Trainer", "PPOTrainer"),
        ("ppotrainr", "PPOTrainer"),
        ("A2CTrainr", "A2CTrainer"),
    ],
)
def test_trainer_suggestions(name: str, expected: str | None) -> None:
    assert closest(name, TRAINERS) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lerning_rate", "learning_rate"),
        ("learningrate", "learning_rate"),
        ("entropy_coef", "entropy_bonus_coef"),  # a block left out
        ("num_iteration", "num_iterations"),
        ("logunifrom", "loguniform"),  # two letters swapped
        ("discount_factor", "discount"),  # a block added
        ("momentum", None),
    ],
)
def test_key_suggestions(name: str, expected: str | None) -> None:
    keys = ["learning_rate", "entropy_bonus_coef", "num_iterations", "loguniform", "uniform", "discount"]
    assert closest(name, keys) == expected


def test_an_unknown_trainer_is_not_said_to_be_another() -> None:
    from mineonline_core.config import load_config
    from mineonline_core.driver.resolve import resolve

    config = {"trainer_name": "SACTrainer", "env_config": {"name": "gymnasium", "id": "CartPole-v1"}}
    with pytest.raises(UnknownComponentError) as info:
        resolve(load_config({**config, "policy_config": {"name": "mlp"}}), get_plugin_manager())
    assert "did you mean" not in str(info.value).lower() and "A2CTrainer?" not in str(info.value)
