"""Suite-wide isolation: Ray and wandb keep process-global state, so no test module may leak it into the next."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator

import pytest

# Every cluster a test starts (``ray.init``, ``ray.cluster_utils.Cluster``, the CLI runs) runs its workers at
# the tests' priority, as a run's own cluster does: at Ray's nice 15 any other busy process on the CI
# machine took the CPU from them, and the suite beside two CPU burners got a quarter of a core.
os.environ.setdefault("RAY_worker_niceness", "0")


def pytest_collection_finish(session: pytest.Session) -> None:
    # The test modules have imported torch and Ray: hundreds of thousands of objects that live until the
    # process ends. Frozen, the collector's full passes during the tests skip them (10-15 % of an
    # in-process test's CPU on this 2-core machine, tests/oracle).
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _no_global_runtime_leaks() -> Iterator[None]:
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    if "wandb" in sys.modules:
        import wandb

        wandb.teardown()
