"""The trainer tutorial (docs/tutorial-trainer-plugin.md) says what its readers will see (fast, no Ray).

Its blocks run in ``tests/test_docs.py`` (the install and training run in ``tests/test_docs_newcomer.py``),
each standing alone, so each writes the plugin's files afresh. These tests keep the copies one file:
the module a reader writes in step 2 is the one steps 3 and 4 install and test, and step 5 only adds
to it. And the output the page shows after each block holds the line that the block itself checks.
"""

from __future__ import annotations

import re

from tests.test_docs import ROOT, extract_blocks

PAGE = ROOT / "docs" / "tutorial-trainer-plugin.md"
BLOCKS = extract_blocks(PAGE)
HEREDOC = re.compile(
    r"^cat > \"?(?:\$plugin/)?(?P<name>[\w.]+)\"? <<'EOF'\n(?P<body>.*?)^EOF$", re.DOTALL | re.MULTILINE
)
CHECK = re.compile(r"\| (?:tail -n 1 \| )?grep (?:-E )?(?P<quote>[\"'])(?P<pattern>.+?)(?P=quote)\s*$", re.MULTILINE)


def _copies(name: str) -> list[str]:
    return [m["body"] for block in BLOCKS for m in HEREDOC.finditer(block.code) if m["name"] == name]


def test_every_copy_of_the_plugin_is_the_same_file_and_step_5_only_adds_to_it() -> None:
    pyprojects = _copies("pyproject.toml")
    assert len(pyprojects) == 2 and len(set(pyprojects)) == 1, pyprojects
    *early, whole = _copies("mineonline_a2c.py")
    assert len(early) == 3 and len(set(early)) == 1, "steps 2, 3 and 4 write different modules"
    remaining = iter(whole.splitlines())
    missing = [line for line in early[0].splitlines() if not any(line == later for later in remaining)]
    assert not missing, f"step 5's module drops or reorders lines of step 2's: {missing}"
    assert "def iteration_metrics" in whole and "def iteration_metrics" not in early[0]


def test_the_output_shown_after_each_runnable_block_holds_what_the_block_checks() -> None:
    runnable = [i for i, block in enumerate(BLOCKS) if block.runnable]
    assert len(runnable) == 5 and sum(BLOCKS[i].slow for i in runnable) == 1
    for i in runnable:
        block, shown = BLOCKS[i], BLOCKS[i + 1]
        assert shown.lang == "text" and not shown.runnable, f"{block.id}: no ```text output after it"
        checks = [m["pattern"] for m in CHECK.finditer(block.code)]
        assert checks, f"{block.id} checks none of its output with grep"
        for pattern in checks:
            assert re.search(pattern, shown.code), f"{shown.id} does not show what {block.id} checks: {pattern!r}"
