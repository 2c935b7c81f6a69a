"""Property test: any input makes ``load_config`` return a config or raise a MineOnlineError."""

from __future__ import annotations

import collections

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from pydantic import BaseModel

from mineonline_core.config import OnlineConfig, load_config
from mineonline_core.config._fields import section_type
from mineonline_core.errors import MineOnlineError


def _key_paths(model: type[BaseModel], prefix: tuple = ()) -> list[tuple[tuple, type]]:
    paths = []
    for name, info in model.model_fields.items():
        sub = section_type(info.annotation)
        paths.append((prefix + (name,), info.annotation))
        if sub is not None:
            paths.extend(_key_paths(sub, prefix + (name,)))
    return paths


KEY_PATHS = _key_paths(OnlineConfig)
SECTIONS = sorted({path[:-1] for path, _ in KEY_PATHS})

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=4),
)
garbage = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)
plausible = st.one_of(
    st.integers(min_value=-3, max_value=500),
    st.floats(min_value=-1, max_value=2, allow_nan=False),
    st.booleans(),
    st.sampled_from(["lmdb", "memory", "wandb", "output", "", "run-1", "1e-4", "PPOTrainer"]),
    st.just(["wandb"]),
    st.just({"name": "crafter"}),
    st.none(),
)
keys = st.one_of(
    st.sampled_from(KEY_PATHS).map(lambda item: item[0]),
    st.sampled_from(KEY_PATHS).map(lambda item: item[0]),
    # Near misses of real keys (typos) and keys placed in the wrong section.
    st.tuples(st.sampled_from(KEY_PATHS), st.integers(0, 30)).map(
        lambda pair: pair[0][0][:-1] + (pair[0][0][-1][: pair[1]] + "x",)
    ),
    st.tuples(st.sampled_from(SECTIONS), st.text(min_size=1, max_size=6)).map(lambda pair: pair[0] + (pair[1],)),
)


def _build(items: list[tuple[tuple, object]]) -> dict:
    data: dict = {}
    for path, value in items:
        node = data
        for key in path[:-1]:
            child = node.get(key)
            node = node.setdefault(key, {}) if not isinstance(child, dict) else child
            if not isinstance(node, dict):
                break
        else:
            node[path[-1]] = value
    return data


def _typed(annotation: object) -> st.SearchStrategy:
    """A value of the field's own type and usual range (these configs mostly validate)."""
    if section_type(annotation) is not None:
        return st.one_of(st.just({}), st.just({"name": "crafter"}))
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return st.integers(min_value=1, max_value=64)
    if annotation is float:
        return st.floats(min_value=0.01, max_value=1.0)
    if annotation == list[str]:
        return st.lists(st.sampled_from(["wandb", "console", "csv"]), max_size=2, unique=True)
    return st.sampled_from(["lmdb", "run-1", "output", None, "PPOTrainer"])


typed_items = st.sampled_from(KEY_PATHS).flatmap(lambda item: st.tuples(st.just(item[0]), _typed(item[1])))
# Weighted towards well-formed input so both outcomes are exercised, not just the first error.
values = st.one_of(plausible, garbage)
items = st.one_of(typed_items, typed_items, typed_items, st.tuples(keys, values))
configs = st.lists(items, max_size=6).map(_build)
override_values = st.one_of(
    st.sampled_from(["1", "-1", "0.5", "null", "[]", "[a, b]", "{x: 1}", "true", "abc", "${x}"]),
    st.text(max_size=8),
)
overrides = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(KEY_PATHS), override_values).map(lambda pair: ".".join(pair[0][0]) + "=" + pair[1]),
        st.text(max_size=15),
    ),
    max_size=2,
)
sources = st.sampled_from(["dict", "dict", "omegaconf", "yaml_dump", "yaml_text"])


def test_load_config_returns_or_raises_mineonline_error(tmp_path):
    outcomes: collections.Counter = collections.Counter()
    yaml_path = tmp_path / "fuzz.yaml"

    @settings(
        max_examples=500,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        data=configs,
        extra=st.one_of(st.just([]), overrides),
        kind=sources,
        text=st.text(max_size=60),
    )
    def run(data, extra, kind, text):
        source: object = data
        if kind == "omegaconf":
            try:
                source = OmegaConf.create(data)
            except Exception:  # OmegaConf rejects some garbage itself; then fuzz the dict
                source = data
        elif kind.startswith("yaml"):
            try:
                body = yaml.safe_dump(data) if kind == "yaml_dump" else text
            except yaml.YAMLError:
                body = text
            yaml_path.write_text(body, encoding="utf-8")
            source = yaml_path
        try:
            loaded = load_config(source, extra)
        except MineOnlineError as exc:
            assert str(exc).strip(), "an error must carry a message"
            outcomes["error"] += 1
            return
        assert isinstance(loaded.config, OnlineConfig)
        assert loaded.config.run_dir().is_absolute()
        outcomes["ok"] += 1

    run()
    assert outcomes["ok"] + outcomes["error"] >= 500
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes
