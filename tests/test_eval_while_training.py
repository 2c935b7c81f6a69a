"""Evaluation while training (issue 26): real CartPole runs with ``train_config.eval_interval`` 1.

* ``eval/*`` metrics reach ``metrics.jsonl`` and the summary at the env steps of the iteration whose
  weights were evaluated; every due evaluation is either logged or counted in ``eval/skipped``;
* ``keep_best`` by ``eval/return_mean`` keeps the checkpoint of the evaluated iteration, and
  ``mineonline eval`` of that checkpoint reports the same return;
* an evaluation never blocks training: an env that holds evaluation episodes until training has
  written its last checkpoint lets every iteration pass (the others are counted as skipped), and the
  evaluation judged after the last iteration keeps the checkpoint of the iteration it evaluated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.config.checks import required_resources
from mineonline_core.errors import ConfigError
from mineonline_core.driver.api import run
from mineonline_core.driver.evaluate import evaluate
from mineonline_core.services.evaluator import EVAL_SEED_OFFSET
from mineonline_core.trainer import checkpoint as ckpt

ITERATIONS = 4
TRAIN = {
    "num_workers": 1,
    "num_cpus_per_worker": 1.0,
    "num_iterations": ITERATIONS,
    "batch_size_per_gpu": 2,
    "batches_per_iteration": 2,
    "gradient_accumulation": 1,
    "context_length": 16,
    "save_interval": 1,
    "keep_interval": 1,
    "record_video_interval": 0,
    "learning_rate": 3e-2,
    "eval_interval": 1,
    "eval_episodes": 2,
    "eval_deterministic": True,
    "eval_num_cpus": 0.5,
}
ROLLOUT = {
    "num_rollout_workers": 1,
    "num_cpus_per_worker": 0.5,
    "fragment_length": 32,
    "worker_config": {"num_envs": 2, "batch_size": 2},
    "replay_buffer_config": {
        "fragments_per_chunk": 1,
        "max_staleness": 3,
        "max_reuse": 2,
        "database_config": {"backend": "memory"},
    },
}


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last(records: list[dict], key: str) -> float:
    return max((r[key] for r in records if key in r), default=0.0)


def assert_kept_weights_are_those_of(run_dir: Path, iteration: int) -> None:
    """The one checkpoint in ``best/`` holds the weights of ``iteration`` (its regular checkpoint's)."""
    [(_, kept)] = ckpt.list_checkpoints(run_dir / "checkpoints" / "best")
    regular = run_dir / "checkpoints" / f"checkpoint_{iteration:06d}"
    kept_weights, regular_weights = (torch.load(p / "model.pt", weights_only=True) for p in (kept, regular))
    assert all(torch.equal(kept_weights[k], regular_weights[k]) for k in regular_weights)
    assert not (run_dir / "checkpoints" / "eval_candidate").exists()


def test_eval_config_is_checked_before_ray_starts() -> None:
    with pytest.raises(
        ConfigError,
        match=r"keep_best_metric is 'eval/return_mean' but eval_interval is 0.*Fix: set train_config.eval_interval",
    ):
        load_config({"train_config": {"keep_best": True, "keep_best_metric": "eval/return_mean"}})
    with pytest.raises(ConfigError, match=r"eval_interval \(10\) exceeds num_iterations \(5\)"):
        load_config({"train_config": {"eval_interval": 10, "num_iterations": 5}})
    with pytest.raises(ConfigError, match="train_config.eval_episodes"):
        load_config({"train_config": {"eval_interval": 1, "eval_episodes": 0}})
    assert load_config({"train_config": {"eval_interval": None}}).config.train_config.eval_interval == 0  # null is off
    config = load_config({"rollout_config": ROLLOUT, "train_config": TRAIN}).config
    assert required_resources(config)["CPU"] == 0.5 + 1.0 + 0.5  # the evaluation actor's CPUs are reserved too


def test_eval_metrics_on_the_step_axis_and_keep_best_by_eval(tmp_path, local_ray) -> None:
    config = {
        "run_name": "evaluated",
        "output_dir": str(tmp_path),
        "logger_config": {"loggers": []},
        "env_config": {"name": "gymnasium", "id": "CartPole-v1", "max_episode_steps": 60},
        "policy_config": {"name": "mlp", "hidden_sizes": [16]},
        "rollout_config": ROLLOUT,
        # vf_warmup: iteration 1 publishes no version, so its evaluation takes weights of its own
        "train_config": {**TRAIN, "keep_best": True, "keep_best_metric": "eval/return_mean", "vf_warmup": 1},
    }
    result = run(config, progress=False)
    assert result["status"] == "completed"
    run_dir = tmp_path / "evaluated"
    records = records_of(run_dir)
    step_of = {int(r["trainer/iteration"]): r["step"] for r in records if "trainer/iteration" in r}
    assert sorted(step_of) == list(range(1, ITERATIONS + 1))
    evals = [r for r in records if "eval/return_mean" in r]
    evaluated = [int(r["eval/iteration"]) for r in evals]
    assert evals and evaluated == sorted(set(evaluated))
    for r in evals:  # on the training's step axis: the env steps of the iteration whose weights were evaluated
        assert r["step"] == step_of[int(r["eval/iteration"])]
        assert (
            r["eval/episodes"] == 2
            and r["eval/length_mean"] >= 1
            and {"eval/return_std", "eval/model_version"} <= r.keys()
        )
    assert len(evals) + last(records, "eval/skipped") == ITERATIONS  # every due evaluation logged or counted
    assert last(records, "eval/failed") == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/return_mean"] == evals[-1]["eval/return_mean"]

    # keep_best by the evaluation: the best evaluated iteration (the first of equals), with its own weights
    returns = {int(r["eval/iteration"]): r["eval/return_mean"] for r in evals}
    best_iteration = max(returns, key=lambda i: (returns[i], -i))
    best_root = run_dir / "checkpoints" / "best"
    best = json.loads((best_root / "best.json").read_text())
    assert best["iteration"] == best_iteration and best["eval/return_mean"] == returns[best_iteration]
    assert best["env_steps"] == step_of[best_iteration]
    assert_kept_weights_are_those_of(run_dir, best_iteration)
    # `mineonline eval` of the kept checkpoint, with its defaults (the run's evaluation settings and seeds),
    # reports the same return, and writes beside the run's other results
    again = evaluate(best_root, progress=False)
    assert again["return_mean"] == returns[best_iteration] and again["seed"] == EVAL_SEED_OFFSET
    assert Path(again["output"]) == run_dir.resolve() / "eval" / "best" / f"checkpoint_{best_iteration:06d}"


GATED = '''
import pathlib
import time

import gymnasium as gym

from mineonline_core.builtin.models import MLPPolicy

LAST_CHECKPOINT = pathlib.Path({last!r})
TIMED_OUT = pathlib.Path({timed_out!r})


class HeldEvaluation(gym.Wrapper):
    """Evaluation episodes (their seeds start at EVAL_SEED_OFFSET) wait until training wrote its last
    checkpoint, which it can only do if it never waits for them; after 60 s they give up and say so."""

    def reset(self, *, seed=None, options=None):
        if seed is not None and seed >= {offset}:
            deadline = time.monotonic() + 60
            while not LAST_CHECKPOINT.exists() and not TIMED_OUT.exists():
                if time.monotonic() > deadline:
                    TIMED_OUT.touch()
                time.sleep(0.1)  # polling for training's event
        return self.env.reset(seed=seed, options=options)


def env_generator():
    return HeldEvaluation(gym.make("CartPole-v1", max_episode_steps=60))


def policy_generator():
    return MLPPolicy(obs_dim=4, num_actions=2, hidden_sizes=[16])
'''


def test_evaluation_never_blocks_training(tmp_path, local_ray) -> None:
    run_dir = tmp_path / "held"
    timed_out = tmp_path / "evaluation_timed_out"
    source = tmp_path / "held_config.py"
    last_checkpoint = run_dir / "checkpoints" / f"checkpoint_{ITERATIONS:06d}"
    train = {**TRAIN, "keep_best": True, "keep_best_metric": "eval/return_mean"}
    source.write_text(
        GATED.format(last=str(last_checkpoint), timed_out=str(timed_out), offset=EVAL_SEED_OFFSET)
        + f"\nonline_dict = {{'run_name': 'held', 'output_dir': {str(tmp_path)!r}, 'logger_config': {{'loggers': []}}, "
        f"'rollout_config': {ROLLOUT!r}, 'train_config': {train!r}}}\n"
    )
    result = run(source, progress=False)
    assert result["status"] == "completed" and result["iteration"] == ITERATIONS
    assert not timed_out.exists()  # the held evaluation was released by training's last checkpoint
    records = records_of(run_dir)
    train = [n for n, r in enumerate(records) if "trainer/iteration" in r]
    evals = [n for n, r in enumerate(records) if "eval/return_mean" in r]
    # Iteration 1's evaluation ran while iterations 2..4 trained (theirs skipped, counted), and was
    # logged after them, at iteration 1's step.
    assert [records[n]["eval/iteration"] for n in evals] == [1]
    assert evals[0] > train[-1] and records[evals[0]]["step"] == records[train[0]]["step"]
    assert last(records, "eval/skipped") == ITERATIONS - 1 and last(records, "eval/failed") == 0
    # Judged once training had moved on to iteration 4: the checkpoint kept is still iteration 1's.
    assert json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())["iteration"] == 1
    assert_kept_weights_are_those_of(run_dir, 1)


def test_a_failed_evaluation_is_counted_and_a_dead_evaluator_replaced(local_ray, caplog, tmp_path) -> None:
    from functools import partial

    import ray

    from mineonline_core.config import OnlineConfig
    from mineonline_core.services.evaluator import start_evaluator
    from mineonline_core.services.names import NAMESPACE
    from mineonline_core.testing.kit import TinyMLPPolicy, faulty_counting
    from mineonline_core.trainer.evaluation import EvaluationClient

    config = OnlineConfig(train_config={"eval_interval": 1, "eval_episodes": 1, "eval_num_cpus": 0.5})
    kwargs = {
        "namespace": NAMESPACE,
        "config": config,
        "policy_generator": partial(TinyMLPPolicy, obs_dim=3),
        "env_generator": partial(faulty_counting, 0, at_steps=(2,)),
    }
    names = ["faulty/evaluator_0", "faulty/evaluator_0_r1", "faulty/evaluator_0_r2"]
    client = EvaluationClient(start=lambda n: start_evaluator(name=names[n], **kwargs), logger_hub=None)
    weights = ray.put({k: v.numpy() for k, v in TinyMLPPolicy(obs_dim=3).state_dict().items()})
    assert client.request(iteration=1, version=1, env_steps=10, weights=weights)
    assert not client.request(iteration=2, version=2, env_steps=20)  # the first one is still handed over: skipped
    assert client.poll(wait=True) == [] and (client.failed, client.skipped) == (1, 1)  # its env raised
    first = client.actor
    ray.kill(first)
    assert client.request(iteration=3, version=3, env_steps=30, weights=weights)
    assert client.poll(wait=True) == [] and client.failed == 2
    assert client.actor._actor_id != first._actor_id  # a dead evaluator is replaced for the next evaluation
    assert client.restarts == 1
    logged = caplog.text
    assert "evaluation of iteration 2 skipped: the evaluation of iteration 1 is still running" in logged
    assert "evaluation of iteration 1 failed" in logged and "evaluation of iteration 3 failed" in logged
    assert "the evaluator actor died" in logged and "starting replacement 1" in logged
    # The dead one's name may still be held (the GCS had not released it when a SIGKILLed evaluator's
    # replacement started): each replacement has a name of its own.
    second = client.actor
    ray.kill(second)
    holder = ray.remote(num_cpus=0)(Holder).options(name=names[1], namespace=NAMESPACE).remote()
    assert client.request(iteration=4, version=4, env_steps=40, weights=weights)
    assert client.poll(wait=True) == [] and client.restarts == 2
    assert client.request(iteration=5, version=5, env_steps=50, weights=weights)
    assert client.poll(wait=True) == [] and client.failed == 4  # the new evaluator ran it (its env raised)
    assert ray.get_actor(names[2], namespace=NAMESPACE)._actor_id == client.actor._actor_id
    ray.kill(client.actor)
    ray.kill(holder)

    # The trainer names its replacements after its own evaluator.
    from types import SimpleNamespace

    from mineonline_core.trainer.evaluation import Evaluating

    trainer = SimpleNamespace(
        train_config=config.train_config,
        rank=0,
        save_dir=tmp_path,
        config=config.model_copy(update={"run_name": "named"}),
        restarts=0,
        policy_generator=kwargs["policy_generator"],
        env_generator=kwargs["env_generator"],
        logger_hub=None,
    )
    Evaluating.start_evaluation(trainer)
    ray.kill(trainer._evaluation.actor)
    replacement = trainer._evaluation._start(1)
    assert ray.get_actor("named/evaluator_0_r1", namespace=NAMESPACE)._actor_id == replacement._actor_id
    ray.kill(replacement)


class Holder:
    """An actor that only holds a name."""


def test_a_running_evaluation_is_polled_without_waiting(local_ray) -> None:
    """Rank 0 asks once per iteration whether the evaluation handed over has finished: while it runs (here its
    env holds its first step for HELD_S seconds) the answer is "not yet" at once, never the result after a wait.
    The whole run with an evaluation held until training ends is ``test_evaluation_never_blocks_training``."""
    from functools import partial

    import ray

    from mineonline_core.config import OnlineConfig
    from mineonline_core.services.evaluator import start_evaluator
    from mineonline_core.services.names import NAMESPACE
    from mineonline_core.testing.kit import TinyMLPPolicy, faulty_counting
    from mineonline_core.trainer.evaluation import EvaluationClient

    held_s = 5.0  # the evaluation's length; the test never waits on it but at the end
    config = OnlineConfig(train_config={"eval_interval": 1, "eval_episodes": 1, "eval_num_cpus": 0.5})
    kwargs = {
        "namespace": NAMESPACE,
        "config": config,
        "policy_generator": partial(TinyMLPPolicy, obs_dim=3),
        "env_generator": partial(faulty_counting, 0, episode_len=3, at_steps=(1,), mode="hang", hang_s=held_s),
    }
    client = EvaluationClient(start=lambda n: start_evaluator(name=f"polled/evaluator_{n}", **kwargs), logger_hub=None)
    try:
        weights = ray.put({k: v.numpy() for k, v in TinyMLPPolicy(obs_dim=3).state_dict().items()})
        request = {"iteration": 1, "version": 1, "env_steps": 10}
        assert client.request(**request, weights=weights)
        assert client.poll() == [], "polled while the evaluation runs, rank 0 got its result: it waited for it"
        assert client.busy == request  # still running: the next due evaluation is skipped, not waited for
        [(done, metrics)] = client.poll(wait=True)  # the end of training waits for it
        assert done == request and metrics["eval/episodes"] == 1 and client.busy is None
    finally:
        ray.kill(client.actor)
