"""Bad input gets ONE clear ``MineOnlineError`` before Ray starts or data is touched.

Each case asserts the message names the key (or file) and the offending value, so a user can fix
it from the message alone. Nothing here starts Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mineonline_core.config import LoadedConfig, check_resources, load_config
from mineonline_core.errors import CheckpointError, ConfigError, UnknownComponentError
from mineonline_core.registry import get_plugin_manager
from mineonline_core.driver.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "run_name": "bad-input",
    "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
}


@pytest.fixture(autouse=True)
def _no_ray_started():
    yield
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a bad-input path started Ray"


# -- config values, types and keys ----------------------------------------------------------------

CASES = [
    ("train_config.learning_rate=-1e-4", "train_config.learning_rate", "-0.0001", "> 0"),
    ("train_config.ppo_clip=0", "train_config.ppo_clip", "0", "> 0"),
    ("train_config.ppo_clip=-0.2", "train_config.ppo_clip", "-0.2", "> 0"),
    ("train_config.gae_lambda=1.5", "train_config.gae_lambda", "1.5", "<= 1"),
    ("rollout_config.fragment_length=0", "rollout_config.fragment_length", "0", ">= 1"),
    ("train_config.num_iterations=many", "train_config.num_iterations", "'many'", "integer"),
    ("rollout_config.worker_config.num_envs=[2]", "rollout_config.worker_config.num_envs", "[2]", "integer"),
    ("train_config.learning_rat=1e-4", "train_config.learning_rat", "0.0001", "learning_rate"),
    ("rollout_config.replay_buffer_config.max_chunk=10", "replay_buffer_config.max_chunk", "10", "max_chunks"),
]


@pytest.mark.parametrize(("override", "key", "value", "hint"), CASES, ids=[c[0] for c in CASES])
def test_config_mistakes_name_key_and_value(override: str, key: str, value: str, hint: str) -> None:
    # The trainer's own train_config keys (ppo_clip; a typo is one of them) are checked by resolve(),
    # against the selected trainer's Config, before the env or the policy is built.
    with pytest.raises(ConfigError) as info:
        resolve(load_config(BASE, [override]), get_plugin_manager(), probe=False)
    message = str(info.value)
    assert key in message and value in message and hint in message, message
    assert "1 problem" in message  # one clear message, not a cascade
    assert "Traceback" not in message


def test_run_rejects_a_bad_value_before_ray_starts(tmp_path: Path) -> None:
    from mineonline_core.driver.api import run

    with pytest.raises(ConfigError, match=r"train_config\.ppo_clip"):
        run(BASE, ["train_config.ppo_clip=0", f"output_dir={tmp_path}"], progress=False)
    assert not (tmp_path / "bad-input").exists()  # no run directory either


def test_impossible_resources() -> None:
    cfg = load_config(BASE, ["rollout_config.num_rollout_workers=4", "rollout_config.num_cpus_per_worker=2"]).config
    with pytest.raises(ConfigError) as info:
        check_resources(cfg, {"CPU": 2.0})
    message = str(info.value)
    assert "CPUs" in message and "rollout_config.num_rollout_workers 4" in message and "has 2" in message
    gpu = load_config(BASE, ["train_config.num_gpus_per_worker=1"]).config
    with pytest.raises(ConfigError, match=r"GPUs.*train_config.num_gpus_per_worker 1.*has 0"):
        check_resources(gpu, {"CPU": 64.0})
    check_resources(cfg, {"CPU": 64.0})  # enough: no error


# -- generators -----------------------------------------------------------------------------------


def _loaded(**generators) -> LoadedConfig:
    data = {k: v for k, v in BASE.items() if k not in ("env_config", "policy_config")}
    loaded = load_config(data)
    loaded.env_generator = generators.get("env_generator", _cartpole)
    loaded.policy_generator = generators.get("policy_generator", _policy)
    return loaded


def _cartpole():
    import gymnasium as gym

    return gym.make("CartPole-v1")


def _policy():
    from mineonline_core.testing.kit import TinyMLPPolicy

    return TinyMLPPolicy(obs_dim=4, n_actions=2)


def test_unserialisable_policy_generator() -> None:
    lock = threading.Lock()

    def policy_generator():
        with lock:
            return _policy()

    with pytest.raises(ConfigError) as info:
        resolve(_loaded(policy_generator=policy_generator), get_plugin_manager())
    assert "policy_generator cannot be serialised" in str(info.value) and "lock" in str(info.value)


def test_unserialisable_env_generator() -> None:
    lock = threading.Lock()
    with pytest.raises(ConfigError, match=r"env_generator cannot be serialised.*lock"):
        resolve(_loaded(env_generator=lambda: (lock, _cartpole())[1]), get_plugin_manager())


def test_generators_that_raise() -> None:
    def broken_env():
        raise FileNotFoundError("no such simulator: /opt/minecraft")

    def broken_policy():
        raise KeyError("pi_head.weight")

    with pytest.raises(ConfigError, match=r"env_generator\(\) raised FileNotFoundError: no such simulator"):
        resolve(_loaded(env_generator=broken_env), get_plugin_manager())
    with pytest.raises(ConfigError, match=r"policy_generator\(\) raised KeyError: 'pi_head.weight'"):
        resolve(_loaded(policy_generator=broken_policy), get_plugin_manager())


# -- checkpoints ----------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from mineonline_core.trainer.checkpoint import save_checkpoint

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(
        tmp_path / "checkpoints",
        iteration=3,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scaler_state=None,
        trainer_state={"version": 3},
        config_yaml="run_name: x\n",
    )


def test_missing_checkpoint(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    with pytest.raises(CheckpointError, match=r"train_config.resume: checkpoint .*nowhere.* does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_corrupted_checkpoint(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    data = bytearray((checkpoint / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    (checkpoint / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.pt.*does not match its sha256"):
        load_checkpoint(checkpoint)


def test_truncated_checkpoint(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    size = (checkpoint / "optimizer.pt").stat().st_size
    os.truncate(checkpoint / "optimizer.pt", size // 2)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*truncated or corrupted"):
        load_checkpoint(checkpoint)
    (checkpoint / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"truncated: optimizer\.pt is missing"):
        load_checkpoint(checkpoint)


def test_half_written_checkpoint_directory(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    (tmp_path / "checkpoint_000004").mkdir()  # a crash before the manifest: no complete checkpoint
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        load_checkpoint(tmp_path)


def test_checkpoint_from_an_incompatible_model(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import check_compatible, load_checkpoint

    state = load_checkpoint(checkpoint)["model"]
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointError) as info:
        check_compatible(other, state, source=str(checkpoint))
    message = str(info.value)
    assert "different model" in message and "missing keys: 0.weight, 0.bias" in message
    assert "unexpected keys: weight, bias" in message
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: weight \(file \(2, 4\), model \(3, 4\)\)"):
        check_compatible(torch.nn.Linear(4, 3), state, source=str(checkpoint))


# -- paths and disks ------------------------------------------------------------------------------


def test_unwritable_save_path(tmp_path: Path) -> None:
    from mineonline_core.driver.api import _prepare_run_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # works as root too, unlike chmod
    loaded = load_config(BASE, [f"output_dir={tmp_path}", f"train_config.save_path={blocker}/checkpoints"])
    resolved = resolve(loaded, get_plugin_manager())
    with pytest.raises(ConfigError) as info:
        _prepare_run_dir(resolved)
    assert "train_config.save_path" in str(info.value) and str(blocker) in str(info.value)


FILL_DISK = """
import resource, signal, sys
import numpy as np
from mineonline_core.errors import MineOnlineError
from mineonline_lmdb.store import LMDBStore

store = LMDBStore(path=sys.argv[1], num_shards=1)
store.put("before", {"x": np.arange(3)})
# A file-size limit makes the store's files unable to grow, exactly as a full disk does (EFBIG
# instead of ENOSPC); SIGXFSZ would kill the process instead of failing the write.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, hard))  # the soft limit only: it can be lifted again
written = 0
try:
    for i in range(1000):
        store.put(f"k{i:04d}", {"x": np.random.default_rng(i).random(1 << 17)})  # 1 MiB each
        written += 1
    print("NO ERROR")
except MineOnlineError as exc:
    print("ERROR", type(exc).__name__, written, exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print("BEFORE", store.get("before")["x"].tolist())
"""


def test_full_disk_on_the_lmdb_store(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FILL_DISK, path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR StoreFullError"), result.stdout
    written = int(error.split()[2])
    assert 1 <= written <= 8  # it failed when the 8 MiB were used up, not before, not never
    assert f"database_config.path={path!r}" in error and "disk is full" in error
    assert "Traceback" not in result.stdout + result.stderr
    assert "BEFORE [0, 1, 2]" in result.stdout  # what was written before is intact


FULL_CHECKPOINT_DISK = """
import os, resource, signal, sys
import torch
from mineonline_core.errors import CheckpointError
from mineonline_core.trainer.checkpoint import list_checkpoints, save_checkpoint, verify_checkpoint

root = sys.argv[1]
def save(iteration, numel):
    model = {"w": torch.ones(numel)}
    return save_checkpoint(root, iteration=iteration, model_state=model, optimizer_state={}, scaler_state=None,
                           trainer_state={"version": iteration}, config_yaml="run_name: x\\n")
save(1, 16)
# A file-size limit makes writes fail exactly as a full disk does (EFBIG instead of ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
try:
    save(2, 1 << 20)  # 4 MiB of weights
    print("NO ERROR")
except CheckpointError as exc:
    print("ERROR", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print("LEFT", sorted(os.listdir(root)))
print("VERIFIED", [verify_checkpoint(p).name for _, p in list_checkpoints(root)])
"""


def test_a_full_disk_while_checkpointing(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FULL_CHECKPOINT_DISK, str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR train_config.save_path: writing checkpoint_000002 under " + repr(str(root))), error
    assert "File too large" in error and "MiB free of" in error and "Fix:" in error
    assert "LEFT ['checkpoint_000001']" in result.stdout  # no temporary directory left behind
    assert "VERIFIED ['checkpoint_000001']" in result.stdout  # the earlier checkpoint is intact


def test_a_checkpoint_directory_that_cannot_be_created(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import save_checkpoint

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # works as root too, unlike chmod
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(
            blocker / "checkpoints",
            iteration=1,
            model_state={},
            optimizer_state={},
            scaler_state=None,
            trainer_state={},
            config_yaml="",
        )
    assert str(blocker / "checkpoints") in str(info.value) and "free of" in str(info.value)


# -- the CLI --------------------------------------------------------------------------------------


def test_cli_unknown_trainer_name(tmp_path: Path) -> None:
    config = ROOT / "examples" / "cartpole.yaml"
    if not config.exists():
        import yaml

        config = tmp_path / "cartpole.yaml"
        config.write_text(yaml.safe_dump(BASE))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "check", str(config), "trainer_name=PPOTrainr"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "PPOTrainr" in result.stderr and "PPOTrainer" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_stop_with_a_negative_grace_names_the_option_and_starts_nothing(capsys) -> None:
    from mineonline_core.cli import main

    assert main(["stop", "some-run", "--grace", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--grace=-5.0" in err and "Fix:" in err


def test_unknown_component_names_list_the_choices() -> None:
    for override, wanted in (
        ("rollout_config.replay_buffer_config.database_config.backend=lmbd", "lmdb"),
        ("logger_config.loggers=[wandbb]", "wandb"),
    ):
        with pytest.raises(UnknownComponentError) as info:
            resolve(load_config(BASE, [override]), get_plugin_manager())
        assert wanted in str(info.value)


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
    lmdb = resolve(load_config(BASE, overrides[:1]), get_plugin_manager()).memory
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
