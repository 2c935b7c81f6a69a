"""Search spaces: the grammar of ``mineonline tune``'s overrides and config values, checked before Ray starts.

An override ``key=value`` is a search space when its value is one of

* ``loguniform(low,high)``, ``uniform(low,high)``: a float drawn per trial (``low < high``; ``low > 0`` for
  loguniform); ``randint(low,high)``: an integer in ``[low, high)``;
* ``choice(a,b,...)``: one of the values drawn per trial;
* ``grid(a,b,...)`` or a bare ``a,b,...``: one trial per value (grids multiply: 2 rates x 3 seeds = 6 trials).

The same strings may stand as values in a YAML config (``learning_rate: loguniform(1e-5,1e-3)``); a
command-line override of the key wins. Values of ``choice`` and ``grid`` stay text and reach the trial as
overrides, so ``[64,64]`` or ``null`` mean what they mean in any override. ``seeds`` is the ``seed`` key's
grid. A trial's run is named after the experiment and its values (``trial_name``). Every value a space
can take at its ends is validated as a config before Ray starts, so a typo or an out-of-range bound is
the usual one-paragraph error, not a failed trial.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from mineonline_core.errors import ConfigError

FUNCTIONS = ("loguniform", "uniform", "randint", "choice", "grid")
SEED_KEY = "seed"
# Keys tune sets for each trial itself: the trial's run directory is named after the experiment and its parameters.
RESERVED = ("run_name", "output_dir")
_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Space:
    """One swept key: ``kind`` is one of ``FUNCTIONS``; ``values`` the texts between the parentheses."""

    key: str
    kind: str
    values: tuple[str, ...]

    @property
    def text(self) -> str:
        return f"{self.key}={self.kind}({','.join(self.values)})"

    def ends(self) -> list[str]:
        """Every value a grid or choice takes, or the bounds of a range: what is validated before Ray."""
        if self.kind == "randint":
            return [self.values[0], str(int(self.values[1]) - 1)]
        return list(self.values)

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        if self.kind == "randint":
            return tune.randint(int(self.values[0]), int(self.values[1]))
        return getattr(tune, self.kind)(float(self.values[0]), float(self.values[1]))


@dataclass(frozen=True)
class TrialSpec:
    """What every trial of an experiment shares (saved as ``tune.json`` for ``--resume``)."""

    source: str | None
    fixed: tuple[str, ...]
    keys: tuple[str, ...]  # the swept keys, in the order trial names show them
    experiment: str
    experiment_dir: str
    metric: str
    cwd: str


def trial_name(spec: TrialSpec, trial_id: str, config: dict) -> str:
    """``<experiment>-<trial number>-<key>=<value>...``: the trial's run name and directory name."""
    number = trial_id.rsplit("_", 1)[-1]
    parts = [spec.experiment, number]
    for key in spec.keys:
        value = config[key]
        shown = f"{value:.3g}" if isinstance(value, float) else str(value)
        parts.append(re.sub(r"[^A-Za-z0-9.=+-]+", "", f"{key.rsplit('.', 1)[-1]}={shown}"))
    return "-".join(parts)


def trial_overrides(spec: TrialSpec, config: dict) -> list[str]:
    """A trial's ``key=value`` per swept key; ``key=?`` for a trial that never reported (pending when a
    sweep was interrupted: Tune hands back no config for it)."""
    return [f"{key}={config.get(key, '?')}" for key in spec.keys]


def _split(text: str) -> tuple[str, ...]:
    """Comma-separated items, commas inside brackets or quotes kept: ``[64,64],[32]`` is two items."""
    items, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(current.strip())
            current = ""
            continue
        current += char
    items.append(current.strip())
    return tuple(items)


def _fail(item: str, why: str, fix: str) -> ConfigError:
    return ConfigError(
        f"search space {item!r}: {why}. Fix: {fix}; the forms are {', '.join(f + '(...)' for f in FUNCTIONS)} "
        "or a bare grid a,b,c (see docs/many-runs.md)."
    )


def parse_space(key: str, value: str) -> Space | None:
    """The space ``key=value`` declares, None for a plain override, or a ``ConfigError`` for bad grammar."""
    item = f"{key}={value}"
    value = value.strip()
    match = _CALL.match(value)
    if match is None:
        if value[:1] in "[{'\"$" or "," not in value:
            return None
        values = _split(value)
        if any(v == "" for v in values):
            raise _fail(item, "an empty value in the grid", "remove the stray comma")
        return Space(key, "grid", values)
    kind, values = match.group(1), _split(match.group(2))
    if kind not in FUNCTIONS:
        close = difflib.get_close_matches(kind, FUNCTIONS, n=1)
        if not close:
            return None  # not ours: an ordinary value that happens to contain parentheses
        raise _fail(item, f"unknown function {kind!r}", f"write {close[0]}(...)")
    if values == ("",) or any(v == "" for v in values):
        raise _fail(item, f"{kind} has an empty value", f"write {kind}(a,b), values separated by single commas")
    if kind in ("choice", "grid"):
        return Space(key, kind, values)
    if len(values) != 2:
        raise _fail(
            item, f"{kind} takes two bounds (low,high), got {len(values)} value(s)", f"write {key}={kind}(low,high)"
        )
    try:
        low, high = (int(v) for v in values) if kind == "randint" else (float(v) for v in values)
    except ValueError:
        number = "integers" if kind == "randint" else "numbers"
        raise _fail(
            item, f"the bounds of {kind} must be {number}", f"write {kind}(low,high) with two {number}"
        ) from None
    if not low < high:
        raise _fail(item, f"low {values[0]} is not below high {values[1]}", f"write {kind}(low,high) with low < high")
    if kind == "loguniform" and low <= 0:
        raise _fail(
            item,
            f"loguniform needs a positive low bound, got {values[0]}",
            "use uniform(...) for ranges that reach 0 or below",
        )
    return Space(key, kind, values)


def split_overrides(overrides: Sequence[str], *, seeds: str | None = None) -> tuple[list[str], list[Space]]:
    """Plain overrides and search spaces, in order; ``seeds`` (``0,1,2``) is a grid over the ``seed`` key."""
    fixed, spaces = [], []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} has no '='. Fix: write key=value, e.g. train_config.learning_rate=grid(1e-4,3e-4)."
            )
        key, value = item.split("=", 1)
        space = parse_space(key.strip(), value)
        if space is None:
            fixed.append(item)
        else:
            spaces.append(space)
    if seeds is not None:
        values = _split(seeds)
        if not values or not all(re.fullmatch(r"\d+", v) for v in values):
            raise ConfigError(f"--seeds {seeds!r}: give non-negative integers separated by commas, e.g. --seeds 0,1,2.")
        spaces.append(Space(SEED_KEY, "grid", values))
    keys = [s.key for s in spaces]
    for key in sorted({k for k in keys if keys.count(k) > 1}):
        raise ConfigError(
            f"{key} is swept twice ({', '.join(s.text for s in spaces if s.key == key)}). "
            "Fix: give one search space per key."
        )
    for space in spaces:
        if space.key in RESERVED:
            raise ConfigError(
                f"{space.text}: tune names each trial's run directory after the experiment and its "
                f"parameters, so {space.key} cannot be swept. Fix: give --name for the experiment."
            )
    return fixed, spaces


def config_spaces(source: Any) -> list[Space]:
    """Search spaces written as values in a YAML config file or a dict config (Python modules have none)."""
    raw: Any = source
    if isinstance(source, (str, Path)) and Path(source).suffix in (".yaml", ".yml") and Path(source).is_file():
        import yaml

        raw = yaml.safe_load(Path(source).read_text())
    if not isinstance(raw, dict):
        return []
    found: list[Space] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
            elif isinstance(value, str) and _CALL.match(value):
                space = parse_space(path, value)
                if space is not None:
                    found.append(space)

    walk(raw, "")
    return found


def validate(source: Any, fixed: Sequence[str], spaces: Sequence[Space]) -> Any:
    """Load the config with every end of every space (the others at their first value); return the
    first combination's ``LoadedConfig``. Raises the config's own error, naming the key, before Ray."""
    from mineonline_core.config import load_config
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve_trainer

    pm = get_plugin_manager()
    base = {s.key: s.ends()[0] for s in spaces}
    first = None
    for space in spaces or [None]:
        for end in space.ends() if space else [None]:
            chosen = {**base, **({space.key: end} if space else {})}
            loaded = load_config(source, [*fixed, *(f"{k}={v}" for k, v in chosen.items())])
            resolve_trainer(loaded, pm)  # the trainer's own train_config keys
            first = first or loaded
    return first
