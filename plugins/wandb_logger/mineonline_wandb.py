"""mineonline-wandb-logger: every metric, histogram and episode video of a run in Weights & Biases.

Select it with ``logger_config.loggers: [wandb]``. Every other ``logger_config`` key this logger
declares goes to ``wandb.init`` (``project``, ``name``, ``entity``, ``group``, ``tags``, ``notes``,
``mode``, ``dir``, ``id``, ``resume``, ``job_type``, ...); a key that no selected logger declares is
rejected by the core with the list of valid keys.

* Offline unless wandb was configured online: ``mode`` in ``logger_config`` wins, then the
  ``WANDB_MODE`` environment variable, else ``offline``. Online without an API key (``WANDB_API_KEY``
  or a netrc entry from ``wandb login``) falls back to offline with a warning; sync later with
  ``wandb sync <run_dir>/wandb/offline-run-*``.
* The run lives in the run directory (``dir`` defaults to it) and stores the full resolved config,
  minus any key that looks like a secret (api_key, token, secret, password).
* One step axis: ``env_steps`` (total env steps) via ``define_metric("*", step_metric="env_steps")``,
  so metrics from rollout and training line up whatever order they arrive in.
* One run across resumes: the wandb run id is stored in the run directory, and a run resumed from
  a checkpoint reopens that run (``resume="allow"``) unless ``id`` is set; the env-step axis goes on.
* ``log_*`` run on the logging actor's feeder thread, never on a hot path, and hand rows to
  ``run.log``, which queues them for wandb's own background process; ``finish`` flushes.

The module imports nothing heavy: wandb loads when the logger is built, inside the logging actor.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
from typing import Any, ClassVar, Literal
from urllib.parse import urlparse

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

import mineonline_core
from mineonline_core.contracts.logger import Logger

log = logging.getLogger(__name__)

STEP_METRIC = "env_steps"
SECRET_KEY = re.compile(r"api[_-]?key|token|secret|passw(or)?d|credential", re.IGNORECASE)
# wandb.Settings a config may set: display, capture and timing only. Where the data goes (base_url,
# proxies, app_url_override), which credentials are used (api_key, credentials_file, identity tokens)
# and what is read or uploaded from disk (root_dir, code_dir, program, ignore_globs) come from the
# environment of the machine that runs the job, never from a config file that may be shared.
SETTINGS_ALLOWED = frozenset(
    {
        "console",
        "console_multipart",
        "quiet",
        "silent",
        "show_colors",
        "show_emoji",
        "show_errors",
        "show_info",
        "show_warnings",
        "disable_code",
        "disable_git",
        "disable_job_creation",
        "label_disable",
        "init_timeout",
        "finish_timeout",
        "heartbeat_seconds",
        "login_timeout",
        "summary_timeout",
        "x_disable_stats",
        "x_disable_meta",
        "x_disable_machine_info",
        "x_stats_sampling_interval",
    }
)


class WandbOptions(BaseModel):
    """The ``logger_config`` keys the wandb logger consumes; each is passed to ``wandb.init``."""

    model_config = ConfigDict(extra="ignore")

    project: str | None = Field(None, description="wandb project the run belongs to.")
    name: str | None = Field(None, description="Display name of the wandb run; defaults to the run name.")
    entity: str | None = Field(None, description="wandb user or team that owns the project.")
    group: str | None = Field(None, description="Group several runs together (e.g. seeds of one experiment).")
    tags: list[str] | None = Field(None, description="Tags of the wandb run.")
    notes: str | None = Field(None, description="A longer description of the run.")
    job_type: str | None = Field(None, description="wandb job type, e.g. 'train'.")
    mode: Literal["online", "offline", "disabled", "shared"] | None = Field(
        None, description="wandb mode; default: WANDB_MODE if set, else 'offline'. Online needs an API key."
    )
    dir: str | None = Field(
        None, description="Where the wandb files go; relative to the run directory; default: the run directory."
    )
    id: str | None = Field(None, description="wandb run id, to resume a specific wandb run.")
    resume: bool | Literal["allow", "never", "must", "auto"] | None = Field(
        None, description="wandb resume behaviour for `id`."
    )
    resume_from: str | None = Field(None, description="Rewind a run to a step: '{run_id}?_step={step}'.")
    fork_from: str | None = Field(None, description="Fork a run at a step: '{run_id}?_step={step}'.")
    config_exclude_keys: list[str] | None = Field(None, description="Top-level config keys not to store in wandb.")
    config_include_keys: list[str] | None = Field(
        None, description="Only these top-level config keys are stored in wandb."
    )
    allow_val_change: bool | None = Field(None, description="Allow config values to change after they are set.")
    save_code: bool | None = Field(None, description="Save the main script or notebook with the run.")
    force: bool | None = Field(None, description="Fail instead of running offline when not logged in (online mode).")
    settings: dict[str, Any] | None = Field(
        None,
        description="wandb.Settings fields that tune display, capture and timing, e.g. {'console': 'wrap'}; "
        "the server, credentials and proxies come from the environment (WANDB_BASE_URL, WANDB_API_KEY, "
        "`wandb login`). Default: console capture off.",
    )

    @field_validator("settings")
    @classmethod
    def _allowed_settings(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        refused = sorted(set(value or {}) - SETTINGS_ALLOWED)
        if refused:
            raise ValueError(
                f"settings {', '.join(refused)} cannot be set from a config: a config file is often shared, and these "
                "would choose where the run's data is sent, with which credentials, or what is read from disk. Set "
                "them in the environment of the machine that runs the job (WANDB_BASE_URL, WANDB_API_KEY or "
                f"`wandb login`, HTTPS_PROXY). Settings a config may set: {', '.join(sorted(SETTINGS_ALLOWED))}"
            )
        return value


def scrub_secrets(tree: Any) -> Any:
    """A copy of a config tree without the keys that look like credentials."""
    if isinstance(tree, dict):
        return {k: scrub_secrets(v) for k, v in tree.items() if not (isinstance(k, str) and SECRET_KEY.search(k))}
    if isinstance(tree, (list, tuple)):
        return type(tree)(scrub_secrets(v) for v in tree)
    return tree


def has_api_key(env: dict[str, str] | None = None) -> bool:
    """Whether wandb could authenticate: ``WANDB_API_KEY`` or a netrc entry for the wandb host.

    Only the presence of a key is checked; its value is never read into the config or the logs.
    """
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str | None, env: dict[str, str] | None = None) -> str:
    """``mode`` key, else ``WANDB_MODE``, else offline; online without an API key becomes offline."""
    env = os.environ if env is None else env
    resolved = mode or env.get("WANDB_MODE") or "offline"
    if resolved == "dryrun":  # wandb's old name for offline
        resolved = "offline"
    if resolved in ("online", "shared", "run") and not has_api_key(env):
        log.warning(
            "wandb mode %r was requested but no API key is configured (WANDB_API_KEY or `wandb login`); "
            "logging offline instead. Sync later with `wandb sync <run_dir>/wandb/offline-run-*`.",
            resolved,
        )
        resolved = "offline"
    return resolved


class WandbLogger(Logger):
    """Sends scalars, histograms and videos to a wandb run, one row per env step."""

    name: ClassVar[str] = "wandb"
    Config: ClassVar[type[BaseModel]] = WandbOptions

    def __init__(self, *, run_dir: str, options: BaseModel | None = None, config: dict[str, Any] | None = None) -> None:
        options = options if options is not None else WandbOptions()
        super().__init__(run_dir=run_dir, options=options, config=config or {})
        import wandb

        self._wandb = wandb
        kwargs = options.model_dump(exclude_none=True)
        settings = {"console": "off", **kwargs.pop("settings", {})}  # the hub's stdout stays ours
        kwargs["mode"] = resolve_mode(kwargs.get("mode"))
        directory = kwargs.get("dir") or run_dir
        kwargs["dir"] = directory if os.path.isabs(directory) else os.path.join(run_dir, directory)
        os.makedirs(kwargs["dir"], exist_ok=True)
        kwargs.setdefault("name", os.path.basename(os.path.normpath(run_dir)))
        previous = self.resumed_run_id()
        if previous is not None and "id" not in kwargs:  # a resumed run continues its wandb run: one curve
            kwargs.update(id=previous, resume=kwargs.get("resume", "allow"))
        self.run = wandb.init(
            **kwargs,
            config=scrub_secrets(self.config),
            settings=wandb.Settings(**settings),
            reinit="create_new",  # several runs per process (tests, a restarted hub) stay apart
        )
        self.keep_run_id(self.run.id)
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        self._row: dict[str, Any] = {}  # the row being merged, sent when the next item cannot join it

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._add(dict(metrics), step)

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size:  # np_histogram: wandb bins it without keeping the raw values (several times cheaper)
            self._add({key: self._wandb.Histogram(np_histogram=np.histogram(values, bins=64))}, step)

    def log_video(self, key: str, path: str, step: int) -> None:
        self._add({key: self._wandb.Video(path, format="mp4")}, step)

    def _add(self, entries: dict[str, Any], step: int) -> None:
        """Merge consecutive items of one step into one row (wandb's per-row cost dominates).

        A key already in the row starts a new row, so two producers logging the same metric at the
        same step both keep their value. Sending is wandb's own business: ``run.log`` only enqueues
        for its background process, so this logger keeps no queue or thread of its own.
        """
        if self._row and (self._row[STEP_METRIC] != step or any(k in self._row for k in entries)):
            self._send()
        if not self._row:
            self._row = {STEP_METRIC: step}
        self._row.update(entries)

    def _send(self) -> None:
        row, self._row = self._row, {}
        if row:
            self.run.log(row)

    def finish(self) -> None:
        """Send the last row and finish the run with its records on disk. ``run.finish()`` returns before
        wandb's service has closed the run's file: read then, an offline run held only its header, and the
        driver ends the logging actor right after this call. Shutting the service down closes the file;
        it is left up while another run of this process still logs."""
        self._send()
        self.run.finish()
        if self._wandb.run is None:
            self._wandb.teardown()


@mineonline_core.hookimpl
def mineonline_register_loggers(register: Any) -> None:
    register(WandbLogger)
