"""Run configuration: pydantic models of MineStudio's ``online_dict`` plus mineonline's keys.

``load_config`` accepts a dict, an OmegaConf object, a YAML file or a Python config module
(``online_dict``, ``env_generator``, ``policy_generator``), applies OmegaConf dotlist overrides,
validates every key (a typo gets a "did you mean") and runs the cross-field checks. Every user
mistake surfaces as one ``ConfigError`` that names the key, the value and the fix.
"""

from __future__ import annotations

from mineonline_core.config._fields import setting
from mineonline_core.config.checks import check_consistency, check_resources
from mineonline_core.config.loading import LoadedConfig, load_config
from mineonline_core.config.messages import validate_online_config
from mineonline_core.config.online import ComponentConfig, LoggerConfig, OnlineConfig
from mineonline_core.config.reference import config_docs, config_template
from mineonline_core.config.rollout import (
    DatabaseConfig,
    EpisodeStatisticsConfig,
    ReplayBufferConfig,
    RolloutConfig,
    WorkerConfig,
)
from mineonline_core.config.train import TrainConfig

__all__ = [
    "ComponentConfig",
    "DatabaseConfig",
    "EpisodeStatisticsConfig",
    "LoadedConfig",
    "LoggerConfig",
    "OnlineConfig",
    "ReplayBufferConfig",
    "RolloutConfig",
    "TrainConfig",
    "WorkerConfig",
    "check_consistency",
    "check_resources",
    "config_docs",
    "config_template",
    "load_config",
    "setting",
    "validate_online_config",
]
