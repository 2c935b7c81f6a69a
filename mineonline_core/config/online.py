"""``OnlineConfig``: the whole run config (MineStudio's ``online_dict`` plus mineonline's keys)."""

from __future__ import annotations

import datetime
import pathlib
import re
from typing import Any

import yaml
from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticSerializationError

from mineonline_core.config._fields import OpenSection, Section, setting
from mineonline_core.config.rollout import RolloutConfig
from mineonline_core.config.train import TrainConfig
from mineonline_core.errors import ConfigError


class LoggerConfig(OpenSection):
    """``logger_config``: which loggers run; other keys go to the selected loggers' ``Config``."""

    loggers: list[str] = Field(
        default_factory=lambda: ["wandb"],
        description="Names of registered loggers to use besides the console logger, which is "
        "always on. [] logs to the console only.",
    )
    project: str = Field("mineonline", description="Project the run is filed under (wandb).")
    name: str | None = Field(None, description="Display name of the run; also the default run_name.")

    @field_validator("loggers")
    @classmethod
    def _no_duplicates(cls, value: list[str]) -> list[str]:
        repeated = sorted({n for n in value if value.count(n) > 1})
        if repeated:
            raise ValueError(f"lists {', '.join(repeated)} more than once; list each logger once")
        return value


class ComponentConfig(OpenSection):
    """``policy_config`` / ``env_config``: a component selected by name, plus its own options."""

    name: str = Field(
        description="Registered name of the component (see `mineonline plugins`); the other "
        "keys are that component's options."
    )


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def _default_run_name(logger_name: str | None) -> str:
    if logger_name:
        cleaned = re.sub(r"[^A-Za-z0-9._=+-]+", "-", logger_name).strip("-.")
        if cleaned:
            return cleaned
    return datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")


class OnlineConfig(Section):
    """The whole config of one online run.

    MineStudio's ``online_dict`` validates unchanged; mineonline adds ``run_name``,
    ``output_dir``, ``seed``, ``policy_config``, ``env_config`` and a few per-section keys.
    A missing ``run_name`` is filled in at validation so every process sees the same run dir.
    """

    trainer_name: str = Field("PPOTrainer", description="Registered name of the trainer class to run.")
    detach_rollout_manager: bool = Field(
        False,
        description="Start the rollout manager as a detached Ray actor that outlives the "
        "driver; end it with `mineonline stop`.",
    )
    run_name: str | None = Field(
        None,
        description="Name of the run directory under output_dir; null means logger_config.name, "
        "else run-YYYYmmdd-HHMMSS.",
    )
    output_dir: str = Field("runs", description="Parent directory of run directories (relative to the working dir).")
    seed: int = setting(0, "Seed of every random generator; each env and worker derives its own from it.", ge=0)
    progress_timeout: float = setting(
        900.0,
        "Seconds without a new env step or without a new training iteration after which the "
        "run fails, naming the last error of every actor and why the replay buffer serves no "
        "chunk; also how long the trainer waits for chunks. 0 disables the watchdog.",
        ge=0,
    )
    hang_timeout: float = setting(
        60.0,
        "Seconds a rollout worker or a Ray Train rank may stay silent (no liveness report) before "
        "it is named as hung, with its pid, node and last report, and killed: Ray restarts a "
        "worker, a rank is restarted from the latest checkpoint (max_trainer_restarts). At least "
        "5 and below progress_timeout; 0 disables it.",
        ge=0,
    )
    rollout_config: RolloutConfig = Field(default_factory=RolloutConfig, description="Experience collection.")
    train_config: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    logger_config: LoggerConfig = Field(default_factory=LoggerConfig, description="Logging.")
    policy_config: ComponentConfig | None = Field(
        None,
        description="Policy selected by name ({name: vpt, ...options}) for runs without a "
        "Python config module; null when a policy_generator is given.",
    )
    env_config: ComponentConfig | None = Field(
        None,
        description="Env selected by name ({name: crafter, ...options}) for runs without a "
        "Python config module; null when an env_generator is given.",
    )
    # Key path -> the interpolation the user wrote (``${oc.env:X}``): saved files keep the expression,
    # not its value (``config.secrets.public_config``).
    _expressions: dict[tuple, str] = PrivateAttr(default_factory=dict)
    policy_generator: str | None = Field(
        None,
        description="The policy generator by import path, 'package.module:function' or "
        "'path/to/config.py:function'; filled in from a Python config module, so a saved config "
        "names the function that builds its policy. null when policy_config names the policy.",
    )
    env_generator: str | None = Field(
        None,
        description="The env generator by import path, like policy_generator; filled in from a "
        "Python config module. null when env_config names the env.",
    )

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_directory_name(cls, value: str | None) -> str | None:
        if value is not None and not _SAFE_NAME.match(value):
            raise ValueError(
                "must be a plain directory name (letters, digits, and . _ = + -, not starting "
                "with . or -) because it names a folder under output_dir"
            )
        return value

    @model_validator(mode="after")
    def _fill_run_name(self) -> OnlineConfig:
        if self.run_name is None:
            self.run_name = _default_run_name(self.logger_config.name)
        return self

    # --- paths --------------------------------------------------------------------------------
    def run_dir(self) -> pathlib.Path:
        """The absolute run directory ``<output_dir>/<run_name>``."""
        return (pathlib.Path(self.output_dir).expanduser() / str(self.run_name)).absolute()

    def resolve_path(self, p: str) -> pathlib.Path:
        """``p`` itself when absolute, else ``run_dir() / p``."""
        path = pathlib.Path(p).expanduser()
        return path if path.is_absolute() else self.run_dir() / path

    # --- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of every key (defaults included), ready for YAML or wandb."""
        try:
            return self.model_dump(mode="json")
        except PydanticSerializationError as exc:
            raise ConfigError(
                f"The config holds a value that cannot be written as YAML/JSON: {exc}. Fix: give "
                f"extra logger_config, database_config, policy_config and env_config keys plain "
                f"values (numbers, strings, booleans, lists, mappings)."
            ) from exc

    def to_yaml(self) -> str:
        """The resolved config as YAML; ``load_config`` reads it back to an equal model."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
