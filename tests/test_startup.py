"""What keeps a run's start-up short: the actors that only keep books never import torch (seconds of
CPU per process on a small machine), and the generators they forward stay pickled until a worker
calls them."""

from __future__ import annotations

import pickle
import subprocess
import sys

from mineonline_core.config.generators import Deferred

BOOKKEEPING = (
    "mineonline_core.rollout.manager",
    "mineonline_core.rollout.buffer",
    "mineonline_core.rollout.stats",
    "mineonline_core.services.storehost",
    "mineonline_core.services.gpulease",
    "mineonline_core.services.loggerhub",
    "mineonline_core.driver.progress",
    "mineonline_lmdb.store",
)


def _fresh_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout


def test_bookkeeping_modules_do_not_import_torch():
    imports = "; ".join(f"import {module}" for module in BOOKKEEPING)
    assert _fresh_python(f"import sys; {imports}; print('torch' in sys.modules)").strip() == "False"


def test_deferred_generator_unpickles_only_when_called(tmp_path):
    from mineonline_core.testing.kit import mlp_policy

    payload = tmp_path / "generator.pkl"
    payload.write_bytes(pickle.dumps(Deferred(mlp_policy)))
    out = _fresh_python(
        "import pickle, sys; from pathlib import Path\n"
        f"gen = pickle.loads(Path({str(payload)!r}).read_bytes()); print('torch' in sys.modules)\n"
        "policy = gen(); print(type(policy).__name__, 'torch' in sys.modules)"
    )
    assert out.split() == ["False", type(mlp_policy()).__name__, "True"]
