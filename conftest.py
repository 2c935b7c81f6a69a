"""Suite-wide isolation: Ray and wandb keep process-global state, so no test module may leak it into the next."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


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
