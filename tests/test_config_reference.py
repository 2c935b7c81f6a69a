"""The generated config reference: the template and ``docs/configuration.md`` (fast, no Ray)."""

from __future__ import annotations

from pathlib import Path

from mineonline_core.config import OnlineConfig, config_docs, config_template, load_config
from tests.test_config_loading import MINESTUDIO_EXAMPLE, _leaves


def test_template_loads_back_to_defaults(tmp_path):
    text = config_template()
    assert "# Initial learning rate" in text and "learning_rate: 2.0e-05" in text
    path = tmp_path / "template.yaml"
    path.write_text(text)
    loaded = load_config(path).config
    # The default trainer's own keys are in train_config too, each at its default.
    from mineonline_ppo import PPOConfig

    assert loaded.train_config.model_extra == PPOConfig().model_dump()
    expected = OnlineConfig(train_config=PPOConfig().model_dump()).model_dump(exclude={"run_name"})
    assert loaded.model_dump(exclude={"run_name"}) == expected


def test_docs_list_every_key_with_type_default_and_range():
    docs = config_docs()
    for path, _ in _leaves(MINESTUDIO_EXAMPLE):
        if path[-1] != "episode_statistics_config":
            assert f"`{'.'.join(path)}`" in docs, path
    assert "| `train_config.gae_lambda` | float | `0.95` | 0 <= x <= 1 |" in docs
    assert "| `train_config.resume` | str \\| None | `null` |" in docs
    assert "## `train_config` keys of the trainer `PPOTrainer` (mineonline-ppo)" in docs
    assert "| `train_config.coef_rho_decay` | float | `0.9995` | 0 < x <= 1 |" in docs
    assert "## Overrides on the command line" in docs


def test_committed_reference_is_current():
    committed = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert committed.read_text(encoding="utf-8") == config_docs(), (
        "docs/configuration.md is stale: run `mineonline config docs --output docs/configuration.md`."
    )
