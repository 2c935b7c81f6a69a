"""A network or a run too big for the machine is refused before it is allocated, or before Ray starts,
with the memory estimate; the estimate counts what a real build allocates.

Nothing here starts Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager
from tests.test_bad_input_config import BASE, ROOT


@pytest.fixture(autouse=True)
def _no_ray_started():
    yield
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a bad-input path started Ray"


# -- sizes ----------------------------------------------------------------------------------------

HUGE = """
import resource, sys
from mineonline_core.cli import main

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # what `prlimit --as` sets: a regression fails, not the machine
sys.exit(main(["check", sys.argv[2]]))
"""


def test_a_huge_network_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    """``hidden_sizes: [1000000000]`` is 13e9 parameters (48 GiB): measured on the meta device, refused
    in seconds with the figure, never allocated (under a 4 GiB address-space limit the allocation itself
    would fail with an allocator error instead of this message)."""
    import yaml

    config = tmp_path / "huge.yaml"
    config.write_text(yaml.safe_dump({**BASE, "policy_config": {"name": "mlp", "hidden_sizes": [1_000_000_000]}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", HUGE, str(4 << 30), str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    message = result.stderr
    assert "13,000,000,006 parameters" in message and "48.4 GiB" in message
    assert "hidden_sizes': [1000000000]" in message and "Fix:" in message
    assert "Traceback" not in message and "allocate" not in message


def test_a_run_that_cannot_fit_the_machine_is_refused_before_ray(tmp_path: Path) -> None:
    from mineonline_core.driver.api import run
    from mineonline_core.driver.budget import machine_memory

    overrides = [
        f"output_dir={tmp_path}",
        "rollout_config.replay_buffer_config.database_config.backend=memory",
        "rollout_config.replay_buffer_config.max_chunks=100000000",
        "rollout_config.fragment_length=512",
        "train_config.context_length=512",
    ]
    with pytest.raises(ConfigError) as info:
        run(BASE, overrides, progress=False)
    message = str(info.value)
    assert "replay (in memory)" in message and machine_memory()[1] in message and "max_chunks" in message
    assert not (tmp_path / "bad-input" / "run.json").exists()


def test_the_memory_estimate_counts_what_a_real_build_allocates() -> None:
    """The meta-device build counts exactly the real policy's parameters and bytes; the in-memory replay
    part is max_chunks x fragments_per_chunk x fragment_length steps of observation, action and columns."""
    from mineonline_core.driver.budget import STEP_COLUMNS_BYTES

    overrides = [
        "policy_config.hidden_sizes=[48,40]",
        "rollout_config.replay_buffer_config.database_config.backend=memory",
        "rollout_config.replay_buffer_config.max_chunks=100",
        "rollout_config.replay_buffer_config.fragments_per_chunk=2",
        "rollout_config.fragment_length=32",
        "train_config.context_length=32",
    ]
    resolved = resolve(load_config(BASE, overrides), get_plugin_manager())
    real = resolved.policy_generator()
    estimate = resolved.memory
    assert estimate.parameters == sum(p.numel() for p in real.parameters())
    assert estimate.policy_bytes == sum(t.numel() * t.element_size() for t in real.state_dict().values())
    step = 4 * 4 + 8 + STEP_COLUMNS_BYTES  # CartPole: 4 float32 observations, an int64 action
    assert estimate.parts["replay (in memory)"] == 100 * 2 * 32 * step
    on_disk = [overrides[0], "rollout_config.replay_buffer_config.database_config.backend=lmdb"]
    lmdb = resolve(load_config(BASE, on_disk), get_plugin_manager()).memory
    assert lmdb.parts["replay (in memory)"] == 0  # an on-disk store holds no replay in memory


def test_the_memory_estimate_counts_the_reference_state_of_every_fragment() -> None:
    """A KL reference adds its recurrent state (``ref_state_in``) to every stored fragment, and its
    weights to every rank and rollout worker: the estimate with and without one differs by exactly that,
    computed from the real policy's ``initial_state(1)`` (a tiny VPT; VPT-2x carries 8 MiB of each)."""
    from mineonline_core.driver.budget import ESTIMATE_COLUMNS_BYTES

    vpt = {
        "env_config": {"name": "crafter", "size": 32},
        "trainer_name": "PPOTrainer",
        "policy_config": {
            "name": "vpt",
            "hidsize": 32,
            "impala_chans": [8, 8, 8],
            "n_recurrence_layers": 2,
            "attention_heads": 2,
            "attention_memory_size": 16,
            "timesteps": 8,
        },
    }
    overrides = [
        "rollout_config.replay_buffer_config.database_config.backend=memory",
        "rollout_config.num_rollout_workers=3",
        "rollout_config.replay_buffer_config.max_chunks=40",
        "rollout_config.replay_buffer_config.fragments_per_chunk=2",
        "rollout_config.fragment_length=8",
        "train_config.context_length=8",
        "train_config.num_workers=2",
        "train_config.batch_size_per_gpu=3",
        "train_config.batches_per_iteration=2",
        "train_config.gradient_accumulation=1",
        "train_config.prefetch_batches=1",
    ]
    without = resolve(load_config({**BASE, **vpt}, overrides), get_plugin_manager())
    with_ref = resolve(
        load_config({**BASE, **vpt}, [*overrides, "train_config.kl_divergence_coef_rho=0.2"]), get_plugin_manager()
    )
    real = with_ref.policy_generator()
    state = sum(t.numel() * t.element_size() for t in torch.utils._pytree.tree_leaves(real.initial_state(1)))
    weights = sum(t.numel() * t.element_size() for t in real.state_dict().values())
    assert state > 0 and with_ref.memory.policy_bytes == without.memory.policy_bytes == weights
    a, b = without.memory.parts, with_ref.memory.parts
    assert b["replay (in memory)"] - a["replay (in memory)"] == 40 * 2 * state
    # Each of the 2 ranks: the reference's weights, and the state of the fragments of its iteration
    # (2 micro-batches of 3 chunks of 2 fragments) and of the one prefetched after it.
    assert b["trainer ranks"] - a["trainer ranks"] == 2 * (weights + 2 * (2 * 3 * 2) * state)
    assert b["rollout workers"] - a["rollout workers"] == 3 * weights  # each runs the reference beside the policy
    assert {k: b[k] - a[k] for k in a if k not in ("replay (in memory)", "trainer ranks", "rollout workers")} == {
        "envs": 0,
        "driver, bookkeeping actors and Ray": 0,
    }
    # The ranks' chunks scale with the micro-batch: one more chunk per micro-batch adds its fragments.
    wider = resolve(
        load_config({**BASE, **vpt}, [*overrides, "train_config.batch_size_per_gpu=4"]), get_plugin_manager()
    )
    fragment = 8 * (32 * 32 * 3 + 8 + 24) + state  # observation, action, step columns, one state
    per_chunk = 2 * (
        2 * fragment + 8 * ESTIMATE_COLUMNS_BYTES
    )  # 2 fragments: held twice (now, prefetched), estimated once
    assert wider.memory.parts["trainer ranks"] - a["trainer ranks"] == 2 * 2 * per_chunk


def test_the_flagship_estimate_counts_8_mib_of_state_per_fragment_and_8_more_for_the_reference() -> None:
    """Issue 24's figure from the VPT-2x shapes (4 blocks of a bool mask and two float32 (memory, hidsize)
    key/value tensors, memory = attention_memory_size - timesteps): the policy is built on the meta device
    only (nothing allocated), and the env is not built (no observation bytes: the states are the point)."""
    from mineonline_core.driver.budget import STEP_COLUMNS_BYTES, estimate_memory

    loaded = load_config(str(ROOT / "examples" / "flagship_vpt2x.yaml"), [])
    resolved = resolve(loaded, get_plugin_manager(), probe=False)
    vpt = loaded.config.policy_config.model_extra
    memory = vpt["attention_memory_size"] - vpt["timesteps"]
    state = vpt["n_recurrence_layers"] * (memory + 2 * memory * vpt["hidsize"] * 4)
    assert state == 8_389_120  # 8.0 MiB
    assert resolved.trainer_cls.has_reference(resolved.trainer_options)  # kl_divergence_coef_rho: 0.2
    args = (resolved.config, resolved.policy_generator, None, None, resolved.store_cls)
    without, with_ref = estimate_memory(*args, reference=False), estimate_memory(*args, reference=True)
    fragments = resolved.config.rollout_config.replay_buffer_config.max_chunks  # one fragment a chunk
    assert with_ref.parts["replay (in memory)"] - without.parts["replay (in memory)"] == fragments * state
    assert without.parts["replay (in memory)"] == fragments * (128 * STEP_COLUMNS_BYTES + state)
