"""Small traps a new user met (issue 26), each pinned by the cheapest test that shows it."""

from __future__ import annotations

import re
from pathlib import Path

from mineonline_core.config.reference import config_docs

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_names_example_files_that_exist() -> None:
    named = set(re.findall(r"examples/[\w./-]+\.(?:py|yaml)", config_docs()))
    assert named, "the configuration page's override example names no example config"
    assert not [path for path in sorted(named) if not (ROOT / path).exists()]
