"""Inputs that used to hang or end in a traceback (issue 28): a config module that loops at import,
a ``fragment_length`` no machine holds, and a Ray cluster that rejects the driver's token."""

from __future__ import annotations

import logging
import re
import signal
from pathlib import Path

import pytest

from mineonline_core.cli import main
from mineonline_core.config import load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager

ROOT = Path(__file__).resolve().parents[2]
CARTPOLE = str(ROOT / "examples" / "cartpole.yaml")


def test_a_config_module_that_loops_at_import_is_interrupted_naming_the_file(
    tmp_path: Path, monkeypatch, capsys, caplog
) -> None:
    from mineonline_core.config import deadline

    module = tmp_path / "looping.py"
    module.write_text(
        "import time\nwhile True:  # waits for a file that never comes\n    try:\n        time.sleep(0.01)\n"
        "    except Exception:\n        pass\nonline_dict = {}\n"
    )
    monkeypatch.setattr(deadline, "NOTE_S", 0.2)
    monkeypatch.setattr(deadline, "LIMIT_S", 1.0)
    handler = signal.getsignal(signal.SIGALRM)
    with caplog.at_level(logging.WARNING, logger="mineonline"):
        code = main(["check", str(module)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"Importing config module {str(module)!r} did not finish within 1s" in err
    assert re.search(r"its top-level code \(at line [2-6]: ", err)  # where the loop was when interrupted
    assert "Fix:" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert [r.getMessage() for r in caplog.records if "still importing" in r.getMessage()] == [
        f"still importing config module {module} after 0s (it runs its top-level code; interrupted at 1s)"
    ]
    # The timer is off and the handler put back: nothing interrupts the process later.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == handler


def test_a_fragment_length_that_does_not_fit_is_refused_naming_the_key_and_the_longest_that_fits() -> None:
    overrides = [
        "rollout_config.fragment_length=10000000",
        "rollout_config.replay_buffer_config.database_config.backend=memory",
    ]
    estimate = resolve(load_config(CARTPOLE, overrides), get_plugin_manager()).memory
    with pytest.raises(ConfigError) as info:
        estimate.check(16 * 2**30, "this test's machine")
    message = str(info.value)
    assert message.startswith("rollout_config.fragment_length: 10000000 steps make the run need about")
    longest = int(message.split("at most ")[1].split(" steps")[0].replace(",", ""))
    assert 256 <= longest < 10_000_000 and "Fix: lower fragment_length" in message
    # the longest it names fits, one step more does not
    rest = estimate.total - estimate.step_bytes * 10_000_000
    assert rest + estimate.step_bytes * longest <= 16 * 2**30 < rest + estimate.step_bytes * (longest + 1)
    # each env's fragment being filled is counted in its rollout worker: 4 envs of CartPole
    assert estimate.parts["rollout workers"] >= 4 * 10_000_000 * (4 * 4 + 8)


def test_a_fragment_length_of_400_digits_is_one_paragraph_not_an_overflow(capsys) -> None:
    code = main(["check", CARTPOLE, f"rollout_config.fragment_length={'9' * 400}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        "error: rollout_config.fragment_length: 999999... (400 digits) steps make one env's fragment about 10^"
    )
    assert "Fix:" in err and "Overflow" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
