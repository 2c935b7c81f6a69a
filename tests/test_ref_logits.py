"""Issue 33 item 2: the KL reference's logits from rollout travel with the fragment (``ref_logits``) and training
does not run the reference again; chunks without them (a store written before the column), or collected before
the reference last changed, run the reference as before.

The chunks come from a real ``FragmentCollector`` over ``TinyImageEnv``s whose episodes end inside fragments, with
a recurrent reference drifted away from the policy, so the KL term is far from 0 and depends on the reference's
own state at each chunk start.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.batch import assemble_chunks
from mineonline_core.trainer.sequence import forward_sequence

FRAGMENT, CONTEXT, PER_CHUNK, ENVS = 8, 5, 2, 4


def make_trainer(tmp_path) -> PPOTrainer:
    train = {
        "num_iterations": 5,
        "batches_per_iteration": 1,  # one micro-batch: the first window's KL is the start policy's
        "batch_size_per_gpu": ENVS,
        "gradient_accumulation": 1,
        "context_length": CONTEXT,
        "learning_rate": 1e-3,
        "discount": 0.9,
        "zero_initial_vf": False,
        "kl_divergence_coef_rho": 0.5,
    }
    config = OnlineConfig(
        train_config=train,
        rollout_config={"fragment_length": FRAGMENT, "replay_buffer_config": {"fragments_per_chunk": PER_CHUNK}},
    )
    trainer = tk.local_loop(PPOTrainer, config, run_dir=str(tmp_path), policy=tk.cnn_policy)
    trainer.iteration = 1
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a reference away from the policy: a KL term far from 0
        for param in trainer.reference.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return trainer


def collect_streams(policy: torch.nn.Module, reference: torch.nn.Module) -> dict[str, list[dict]]:
    """Each env's fragments in order, from its first step on."""
    envs = [functools.partial(tk.TinyImageEnv, seed=i, mean_length=6) for i in range(ENVS)]
    collector = tk.collector(
        policy=copy.deepcopy(policy),
        env_fns=envs,
        fragment_length=FRAGMENT,
        batch_size=ENVS,
        env_processes=False,
        seed=0,
    )
    collector.set_reference(reference.state_dict())
    try:
        frags = collector.collect(ENVS * 2 * PER_CHUNK)
    finally:
        collector.close()
    streams: dict[str, list[dict]] = {}
    for frag in sorted(frags, key=lambda f: (f[F.STREAM], f[F.INDEX])):
        streams.setdefault(frag[F.STREAM], []).append(frag)
    return streams


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trainer and each stream's fragments (the reference ran beside the policy)."""
    trainer = make_trainer(tmp_path_factory.mktemp("run"))
    return trainer, collect_streams(trainer.policy, trainer.reference)


def later_chunks(streams: dict[str, list[dict]], *, stored: bool) -> list[list[dict]]:
    """Each stream's second chunk (it starts mid-episode), with or without the stored logits."""
    chunks = [frags[PER_CHUNK : 2 * PER_CHUNK] for frags in streams.values()]
    if not stored:
        chunks = [[{k: v for k, v in f.items() if k != F.REF_LOGITS} for f in chunk] for chunk in chunks]
    return chunks


def count_reference_calls(trainer: PPOTrainer) -> list[int]:
    calls = [0]
    forward = trainer.reference.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    trainer.reference.forward = counted
    return calls


def train_once(tmp_path, world, chunks: list[list[dict]], *, reference_since: int = 0):
    """A fresh trainer (the world's weights) trained on ``chunks`` for two iterations: the first's metrics, the
    parameters after both, the reference's calls, the batch."""
    source, _ = world
    trainer = make_trainer(tmp_path)
    trainer.reference.load_state_dict(source.reference.state_dict())
    trainer.reference_since = reference_since
    calls = count_reference_calls(trainer)
    batch = trainer.algorithm.estimate(batch=assemble_chunks(chunks))
    metrics = trainer.train(batch)
    trainer.train(trainer.algorithm.estimate(batch=assemble_chunks(chunks)))
    params = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    return metrics, params, calls[0], batch


def exact_kl(world) -> float:
    """Both policies over each env's whole stream from its start; the KL over the later chunks' steps."""
    trainer, streams = world
    whole = assemble_chunks([frags[: 2 * PER_CHUNK] for frags in streams.values()])
    with torch.no_grad():
        pi, _ = forward_sequence(trainer.policy, whole[F.OBS], whole[F.STATE_IN], whole[F.FIRST], context_length=1)
        ref, _ = forward_sequence(
            trainer.reference, whole[F.OBS], trainer.reference.initial_state(ENVS), whole[F.FIRST], context_length=1
        )
        kl = trainer.policy.pi_head.kl_divergence(pi["pi_logits"], ref["pi_logits"])
    return kl.reshape(ENVS, -1)[:, PER_CHUNK * FRAGMENT :].mean().item()


def test_rollout_records_the_logits_the_reference_produced_at_each_step(world):
    """(e) Each step's stored logits are those of a plain step-by-step run of the reference over the stream."""
    trainer, streams = world
    for frags in streams.values():
        assert all(f[F.REF_LOGITS].dtype == np.float32 and f[F.REF_LOGITS].shape == (FRAGMENT, 3) for f in frags)
        obs = np.concatenate([f[F.OBS]["image"] for f in frags])
        first = np.concatenate([f[F.FIRST] for f in frags])
        assert first[0] and first[1:].any()  # episodes end inside the stream: the reference's state resets there
        state, expected = trainer.reference.initial_state(1), []
        with torch.no_grad():
            for t in range(len(first)):
                latents, state = trainer.reference(
                    input={"image": torch.as_tensor(obs[t : t + 1, None])},
                    state_in=state,
                    context={"first": torch.as_tensor(first[t : t + 1, None])},
                )
                expected.append(latents["pi_logits"][0, 0])
        stored = torch.as_tensor(np.concatenate([f[F.REF_LOGITS] for f in frags]))
        torch.testing.assert_close(stored, torch.stack(expected), rtol=1e-5, atol=1e-6)


def test_stored_logits_give_the_kl_and_update_of_running_the_reference(tmp_path, world):
    """(a) and (b): with the stored logits the reference never runs at training, and the KL term and the whole
    update's parameters equal those of running the reference (the fallback) up to rollout / training rounding."""
    stored = train_once(tmp_path / "stored", world, later_chunks(world[1], stored=True))
    ran = train_once(tmp_path / "ran", world, later_chunks(world[1], stored=False))
    assert F.REF_LOGITS in stored[3] and F.REF_LOGITS not in ran[3]
    assert stored[2] == 0 and ran[2] > 0
    kl = ran[0]["trainer/kl_ref"]
    assert kl == pytest.approx(exact_kl(world), rel=1e-5) and kl > 1e-3
    assert stored[0]["trainer/kl_ref"] == pytest.approx(kl, rel=1e-5)
    for name, param in ran[1].items():
        torch.testing.assert_close(stored[1][name], param, rtol=1e-5, atol=1e-6, msg=name)


def test_chunks_without_the_column_run_the_reference_from_its_stored_state(tmp_path, world):
    """(c) A batch with one old-format chunk (no ``ref_logits``) trains, running the reference from each chunk's
    ``ref_state_in`` (chunks that start mid-episode): the exact KL over the whole streams."""
    chunks = later_chunks(world[1], stored=True)
    chunks[0] = later_chunks(world[1], stored=False)[0]
    metrics, _, calls, batch = train_once(tmp_path, world, chunks)
    assert F.REF_LOGITS not in batch and calls > 0
    assert metrics["trainer/kl_ref"] == pytest.approx(exact_kl(world), rel=1e-5)


def test_logits_stored_before_the_reference_changed_are_not_used(tmp_path, world):
    """After ``reference_changed`` (a ``ref_update_at_checkpoint`` refresh, or a resume) chunks of versions
    older than the next broadcast's carry the old reference's logits: training runs the reference for them."""
    trainer, streams = world
    chunks = later_chunks(streams, stored=True)
    assert all(int(f[F.VERSION].max()) == 0 for chunk in chunks for f in chunk)
    metrics, _, calls, _ = train_once(tmp_path, world, chunks, reference_since=1)
    assert calls > 0
    assert metrics["trainer/kl_ref"] == pytest.approx(exact_kl(world), rel=1e-5)
    before = trainer.reference_since
    trainer.version = 3
    trainer.reference_changed()
    assert trainer.reference_since == 4  # the broadcast after the change carries version 4
    trainer.reference_since = before


def test_the_column_survives_the_lmdb_store(tmp_path):
    """(d) ``ref_logits`` (a tree like ``pi_logits``) round-trips the LMDB store bit for bit."""
    from mineonline_lmdb import LMDBStore

    torch.manual_seed(0)
    policy, reference = tk.TinyGRUPolicy(), tk.TinyGRUPolicy()
    streams = tk.rollout_fragments(policy, tk.counting, num_envs=2, fragments_per_env=2, reference=reference)
    frags = [f for fs in streams.values() for f in fs]
    assert all(f[F.REF_LOGITS].shape == (8, 2) and f[F.REF_STATE_IN][0].shape == (1, 8) for f in frags)
    store = LMDBStore(path=str(tmp_path / "store"), num_shards=2, resume=False, options=LMDBStore.Config())
    try:
        for f in frags:
            store.put(F.fragment_key(f[F.STREAM], f[F.INDEX]), f)
        for f in frags:
            back = store.get(F.fragment_key(f[F.STREAM], f[F.INDEX]))
            assert back[F.REF_LOGITS].dtype == np.float32
            np.testing.assert_array_equal(back[F.REF_LOGITS], f[F.REF_LOGITS])
    finally:
        store.close()
