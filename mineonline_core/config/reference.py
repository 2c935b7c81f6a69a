"""Generated references: the commented YAML template and the Markdown key reference.

Both are written from the models' fields, so they cannot drift from what is validated.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from typing import Any

import yaml
from pydantic import BaseModel

from mineonline_core.config._fields import OpenSection, range_text, section_type, type_text
from mineonline_core.config.online import OnlineConfig
from mineonline_core.config.train import TrainConfig

_WIDTH = 100


def _scalar(value: Any) -> str:
    """One YAML scalar or flow collection, as it would appear after ``key: ``."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def _sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """Every section model with its dotted path, depth first; the top level first."""
    yield prefix, model
    for name, info in model.model_fields.items():
        sub = section_type(info.annotation)
        if sub is not None:
            yield from _sections(sub, f"{prefix}.{name}" if prefix else name)


def installed_trainers() -> list[tuple[str, type[BaseModel], str]]:
    """(name, ``Config``, distribution) of every installed trainer, by name."""
    from mineonline_core.registry import get_plugin_manager

    return [
        (name, cls.Config, origin.distribution)
        for name, cls, origin in get_plugin_manager().registries["trainer"].items()
    ]


def _template_lines(
    model: type[BaseModel], indent: int, extra: dict[type[BaseModel], type[BaseModel]] | None = None
) -> list[str]:
    """``extra``: a section model -> the plugin model whose keys are written into it too."""
    pad, lines = " " * indent, []
    fields = list(model.model_fields.items())
    if extra and model in extra:
        fields += list(extra[model].model_fields.items())
    for name, info in fields:
        if indent == 0 and lines:
            lines.append("")
        for line in textwrap.wrap(info.description or "", width=_WIDTH - indent - 2, break_on_hyphens=False):
            lines.append(f"{pad}# {line}")
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.extend(_template_lines(type(default), indent + 2, extra))
        else:
            lines.append(f"{pad}{name}: {_scalar(default)}")
    return lines


def config_template(trainers: list[tuple[str, type[BaseModel], str]] | None = None) -> str:
    """The full default config as YAML, each key preceded by its description as a comment; the
    default trainer's own keys (``trainers``: ``installed_trainers()`` when None) in train_config."""
    header = [
        "# mineonline run config: every key at its default. `mineonline config docs` explains",
        "# each key; relative paths are resolved under <output_dir>/<run_name>.",
        "",
    ]
    default = OnlineConfig.model_fields["trainer_name"].default
    own = {name: model for name, model, _ in (installed_trainers() if trainers is None else trainers)}
    extra = {TrainConfig: own[default]} if default in own else None
    return "\n".join(header + _template_lines(OnlineConfig, 0, extra)) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_table(path: str, model: type[BaseModel], title: str | None = None) -> list[str]:
    title = title or (f"`{path}`" if path else "Top level")
    doc = (model.__doc__ or "").strip().splitlines()
    lines = [f"## {title}", ""]
    if path and doc:
        lines += [" ".join(part.strip() for part in doc if part.strip()), ""]
    lines += ["| Key | Type | Default | Valid range | Description |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        if info.is_required():
            default = "(required)"
        else:
            value = info.get_default(call_default_factory=True)
            default = "(section)" if isinstance(value, BaseModel) else f"`{_scalar(value)}`"
        description = (info.description or "").split(" Valid range:")[0]
        lines.append(
            f"| `{key}` | {_cell(type_text(info.annotation))} | {_cell(default)} | "
            f"{_cell(range_text(info)) or '-'} | {_cell(description)} |"
        )
    if issubclass(model, OpenSection):
        lines += [
            "",
            "Other keys in this section are allowed: they are passed to the component "
            "the section selects and checked against that component's own `Config`.",
        ]
    return lines + [""]


_FROM_SCRATCH = (
    "The defaults in the tables above are MineStudio's, for fine-tuning a pretrained policy (VPT): "
    "learning rate 2e-5, discount 0.999, 4,000 iterations, wandb and the LMDB store. A config whose "
    "`policy_config` names a policy without `weights_path` (the key a policy loads pretrained weights "
    "from), and which gives no `policy_generator`, trains a policy from scratch: for it, each group of "
    "keys below that the config leaves out (none of the group's keys set, in the file or by an "
    "override) takes PPO's settings for control tasks instead, and `mineonline run` and `mineonline "
    "check` print the line `from-scratch defaults: ...` with the keys filled in. They are written into "
    "the run's config.yaml like keys the config set. A MineStudio `online_dict` (with its "
    "`policy_generator`) and a config that names pretrained weights keep the fine-tuning defaults. "
    "`env_config: {name: gymnasium, id: CartPole-v1}` with `policy_config: {name: mlp}` learns "
    "CartPole with these alone (tests/test_from_scratch.py)."
)


def _from_scratch_section() -> list[str]:
    from mineonline_core.config.scratch import FROM_SCRATCH

    lines = ["## Defaults for a policy trained from scratch", "", *textwrap.wrap(_FROM_SCRATCH, width=_WIDTH), ""]
    lines += ["| Group | Key | From scratch | Fine-tuning (the table above) |", "|---|---|---|---|"]
    for group, keys in FROM_SCRATCH:
        for path, value in keys.items():
            model: Any = OnlineConfig
            for name in path[:-1]:
                model = section_type(model.model_fields[name].annotation)
            info = model.model_fields[path[-1]]
            default = info.default_factory() if info.default_factory is not None else info.default
            lines.append(f"| {group} | `{'.'.join(path)}` | `{_scalar(value)}` | `{_scalar(default)}` |")
    return lines + [""]


_CHECKS = (
    "Before any actor starts: `batches_per_iteration` is a multiple of `gradient_accumulation`; "
    "`worker_config.batch_size <= num_envs`; one iteration's chunks (`num_workers x "
    "batches_per_iteration x batch_size_per_gpu`) fit in `max_chunks`; `context_length <= "
    "fragment_length x fragments_per_chunk`; and the Ray cluster has the CPUs and GPUs that the "
    "rollout and train workers reserve (`mineonline run` checks this once Ray is up)."
)

_OVERRIDES = """\
## Overrides on the command line

Any key can be overridden with an OmegaConf dotlist item `key.path=value`, applied after the file
is read and before validation, for example:

```
mineonline run examples/crafter.py train_config.learning_rate=1e-4 \\
    rollout_config.worker_config.num_envs=8 logger_config.loggers=[] train_config.resume=null
```

Values are parsed as YAML (`1e-4` is a number, `null` is None, `[a, b]` a list). An override of an
unknown key fails with the same "did you mean" message as a typo in the file, and names the
override. Interpolations (`${...}`) are resolved inside config files, not inside overrides.
"""


def config_docs(trainers: list[tuple[str, type[BaseModel], str]] | None = None) -> str:
    """Markdown reference of every key: path, type, default, valid range and description; then the
    own ``train_config`` keys of each trainer in ``trainers`` (``installed_trainers()`` when None)."""
    lines = [
        "# Configuration reference",
        "",
        "A run is configured by one mapping: MineStudio's `online_dict`, accepted unchanged, plus",
        "mineonline's additions (`run_name`, `output_dir`, `seed`, `policy_config`, `env_config`,",
        "`database_config.backend`, `logger_config.loggers`, ...). It can be a dict, an OmegaConf",
        "object, a YAML file, or a Python module defining `online_dict` with `env_generator` and",
        "`policy_generator`. Unknown keys are errors with a suggestion; relative paths",
        "(`save_path`, `video_output_dir`, `database_config.path`) are resolved under the run",
        "directory `<output_dir>/<run_name>`. `mineonline config template` prints a commented file",
        "with every default. This page is generated by `mineonline config docs`.",
        "",
    ]
    for path, model in _sections(OnlineConfig):
        lines += _section_table(path, model)
    for name, options, distribution in installed_trainers() if trainers is None else trainers:
        lines += _section_table(
            "train_config", options, f"`train_config` keys of the trainer `{name}` ({distribution})"
        )
    lines += _from_scratch_section()
    lines += ["## Cross-field checks", "", *textwrap.wrap(_CHECKS, width=_WIDTH), "", _OVERRIDES]
    return "\n".join(lines)
