"""mineonline: online RL fine-tuning of pretrained policies, distributed on Ray.

The public API. Heavy modules (Ray actors, the trainer) load on first use so that ``import
mineonline_core`` and the CLI's error paths stay fast.
"""

from __future__ import annotations

from typing import Any

from mineonline_core.errors import ConfigError, MineOnlineError, UnknownComponentError
from mineonline_core.contracts.hookspecs import hookimpl
from mineonline_core.contracts.logger import Logger
from mineonline_core.contracts.store import FragmentStore

__version__ = "0.1.0"

_LAZY = {
    "Algorithm": "mineonline_core.trainer.algorithm",  # what a trainer plugin subclasses
    "TrainerOptions": "mineonline_core.trainer.algorithm",
    "TrainLoop": "mineonline_core.trainer.loop",
    "BaseTrainer": "mineonline_core.trainer.base",  # the base class before Algorithm
    "setting": "mineonline_core.config",  # a trainer option with its help text and bounds
    "Columns": "mineonline_core.contracts.batch",  # compute_loss's batch keys: batch[Columns.ADVANTAGE]
    "Outputs": "mineonline_core.contracts.batch",  # compute_loss's outputs keys: outputs[Outputs.PI_LOGITS]
    "TrainBatch": "mineonline_core.contracts.batch",
    "ModelOutputs": "mineonline_core.contracts.batch",
    "unwrap": "mineonline_core.trainer.sequence",  # a policy inside DDP or torch.compile
    "Policy": "mineonline_core.contracts.policy",  # imports torch: not for processes that never build a network
    "EnvFactory": "mineonline_core.contracts.envs",
    "load_config": "mineonline_core.config",
    "OnlineConfig": "mineonline_core.config",
    "get_plugin_manager": "mineonline_core.registry",
    "start_rolloutmanager": "mineonline_core.driver.api",
    "start_trainer": "mineonline_core.driver.api",
    "run": "mineonline_core.driver.api",
    "tune": "mineonline_core.driver.tune",
    "load_policy": "mineonline_core.driver.evaluate",
    "evaluate": "mineonline_core.driver.evaluate",
}

__all__ = [
    "ConfigError",
    "FragmentStore",
    "Logger",
    "MineOnlineError",
    "Policy",
    "UnknownComponentError",
    "hookimpl",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mineonline_core' has no attribute {name!r}")
