"""Small traps a new user met (issue 26), each pinned by the cheapest test that shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from mineonline_core.config.reference import config_docs

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_page_names_example_files_that_exist() -> None:
    named = set(re.findall(r"examples/[\w./-]+\.(?:py|yaml)", config_docs()))
    assert named, "the configuration page's override example names no example config"
    assert not [path for path in sorted(named) if not (ROOT / path).exists()]


def _script(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_script_calling_run_without_main_guard_is_told_so(tmp_path: Path) -> None:
    done = _script(tmp_path, "import mineonline_core\n\nresult = mineonline_core.run('examples/cartpole.yaml', "
                             "['train_config.num_iterations=1'])\n")  # fmt: skip
    assert done.returncode != 0
    assert 'train.py:3 calls run() when the script is imported, not under `if __name__ == "__main__":`' in done.stderr
    assert "native" not in done.stderr and not (ROOT / "runs" / "train").exists()


def test_guarded_script_and_functions_pass_the_check(tmp_path: Path) -> None:
    done = _script(tmp_path, textwrap.dedent("""\
        from mineonline_core.runtime.mainguard import unguarded_call_site

        def main():
            return unguarded_call_site()

        if __name__ == "__main__":
            assert main() is None
            print("guarded ok")
        """))
    assert done.returncode == 0 and "guarded ok" in done.stdout, done.stderr
