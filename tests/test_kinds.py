"""The kinds' records (``mineonline_core/contracts/kinds.py``) are the one place a kind is described:
its hook spec, the registry's checks and messages, ``mineonline plugins`` and the table in
``docs/plugins.md`` all follow from them (fast, no Ray)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import mineonline_core
from mineonline_core.contracts import hookspecs
from mineonline_core.contracts.kinds import KINDS, Kind
from mineonline_core.errors import UnknownComponentError
from mineonline_core.registry import PluginManager, kind_table, with_kind_table

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "plugins.md"


def test_committed_kind_table_is_current() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert kind_table() in page
    assert page == with_kind_table(page), (
        "docs/plugins.md's kind table is stale: run `mineonline plugins --table --output docs/plugins.md`."
    )


def test_the_table_has_a_row_per_hook_spec() -> None:
    table = kind_table()
    specs = [name for name in vars(hookspecs) if name.startswith("mineonline_")]
    assert len(table.splitlines()) == 2 + len(specs)
    for kind in KINDS:
        assert f"| `{kind.hook}(register)` | {kind.plural} | `{kind.exported_base}` | `{kind.config_key}` |" in table


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_kind_has_its_hook_spec_written_from_its_record(kind: Kind, plugin_manager: PluginManager) -> None:
    spec = getattr(hookspecs, kind.hook)
    assert spec.__name__ == kind.hook and kind.config_key in spec.__doc__ and kind.exported_base in spec.__doc__
    assert plugin_manager.hook.__dict__[kind.hook].spec is not None  # pluggy took it as a spec
    assert kind.name in plugin_manager.registries and plugin_manager.registries[kind.name].kind is kind


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_base_a_plugin_imports_is_the_one_the_registry_checks(kind: Kind) -> None:
    defined = getattr(importlib.import_module(kind.base_module), kind.base_name)
    assert getattr(mineonline_core, kind.base_name) is defined


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_the_unknown_name_error_speaks_of_the_kind(kind: Kind, plugin_manager: PluginManager) -> None:
    with pytest.raises(UnknownComponentError) as info:
        plugin_manager.lookup(kind.name, "no-such-component")
    message = str(info.value)
    assert message.startswith(f"{kind.config_key}: no {kind.label} named 'no-such-component'")
    assert f"Available {kind.plural}:" in message


def test_a_well_known_name_points_at_its_distribution(plugin_manager: PluginManager) -> None:
    registry = plugin_manager.registries["trainer"]
    origin = registry.origin("PPOTrainer")
    registry.remove_origin(origin)  # as if mineonline-ppo were not installed
    assert "PPOTrainer" not in registry
    with pytest.raises(UnknownComponentError, match="pip install mineonline-ppo"):
        plugin_manager.lookup("trainer", "PPOTrainer")


def test_cli_lists_each_kind_under_its_plural_and_rewrites_the_table(tmp_path: Path) -> None:
    cli = Path(sys.executable).parent / "mineonline"
    listing = subprocess.run([str(cli), "plugins"], capture_output=True, text=True, timeout=60, check=True).stdout
    headings = [line[:-1] for line in listing.splitlines() if not line.startswith(" ") and line != "failed to load:"]
    assert headings == [kind.plural for kind in KINDS]
    stale = tmp_path / "page.md"
    original = PAGE.read_text(encoding="utf-8")
    stale.write_text(original.replace("| trainers |", "| trainer classes |"))
    check = subprocess.run(
        [str(cli), "plugins", "--table", "--output", str(stale), "--check"], capture_output=True, text=True, timeout=60
    )
    assert check.returncode != 0 and "out of date" in check.stderr
    subprocess.run([str(cli), "plugins", "--table", "--output", str(stale)], check=True, timeout=60)
    assert stale.read_text() == original


def test_the_suggested_setting_is_a_list_where_the_key_holds_several(plugin_manager: PluginManager) -> None:
    with pytest.raises(UnknownComponentError, match=r"Set logger_config\.loggers=\[console\]\."):
        plugin_manager.lookup("logger", "consol")
    with pytest.raises(UnknownComponentError, match=r"Set policy_config\.name=mlp\."):
        plugin_manager.lookup("policy", "mpl")
