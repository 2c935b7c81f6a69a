"""Small traps a new user met (issue 26), each pinned by the cheapest test that shows it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml

import mineonline_core
from mineonline_core.config.reference import config_docs
from mineonline_core.errors import ConfigError

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
    done = _script(
        tmp_path,
        "import mineonline_core\n\nresult = mineonline_core.run('examples/cartpole.yaml', "
        "['train_config.num_iterations=1'])\n",
    )
    assert done.returncode != 0
    assert 'train.py:3 calls run() when the script is imported, not under `if __name__ == "__main__":`' in done.stderr
    assert "native" not in done.stderr and not (ROOT / "runs" / "train").exists()


def test_guarded_script_and_functions_pass_the_check(tmp_path: Path) -> None:
    done = _script(
        tmp_path,
        textwrap.dedent("""\
        from mineonline_core.driver.mainguard import unguarded_call_site

        def main():
            return unguarded_call_site()

        if __name__ == "__main__":
            assert main() is None
            print("guarded ok")
        """),
    )
    assert done.returncode == 0 and "guarded ok" in done.stdout, done.stderr


def test_run_from_a_notebook_defined_generator_is_refused_before_ray(tmp_path: Path) -> None:
    # What a notebook cell does: functions (and classes) defined in module __main__, which has no file.
    cell = {"__name__": "__main__"}
    exec("from mineonline_core.testing.kit import mlp_policy\ndef policy_generator():\n    return mlp_policy()\n", cell)
    notebook = types.ModuleType("notebook_config")
    notebook.online_dict = {
        **yaml.safe_load((ROOT / "examples" / "cartpole.yaml").read_text()),
        "policy_config": None,
        "output_dir": str(tmp_path),
    }
    notebook.policy_generator = cell["policy_generator"]
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized()
    with pytest.raises(
        ConfigError, match=r"policy_generator: '__main__\.policy_generator' cannot be named .* load_policy"
    ):
        mineonline_core.run(notebook, progress=False)
    assert not list(tmp_path.iterdir()) and (sys.modules.get("ray") is None or not sys.modules["ray"].is_initialized())
