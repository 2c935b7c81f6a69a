"""Which weights an evaluation while training runs (``trainer/evaluation.py``), iteration by iteration.

DESIGN §5.6 and the evaluation module: every ``eval_interval`` iterations the evaluator gets the weights
*of that iteration*, the ones its checkpoint holds, so that ``keep_best`` by ``eval/return_mean`` keeps
exactly what was evaluated. PPO's ``vf_warmup`` iterations publish no version: their weights changed
(every parameter trains on the value loss and the KL) but the last broadcast still holds the previous
ones. The evaluation of a warm-up iteration must run the warm-up's own weights, not the broadcast's.

A real PPOTrainer runs ``run_iteration`` on a local Ray cluster with two stubs: ``fetch_chunks`` hands
it chunks from a step-by-step rollout, and the evaluator actor is a recorder of what it was handed.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import ray
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.testing.kit import cartpole, chunks_of, mlp_policy, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks
from mineonline_core.trainer.evaluation import EvaluationClient
from mineonline_core.trainer.loop import TrainLoop


class RecordingEvaluator:
    """Stands in for the Evaluator actor: records the weights and request of each evaluation."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, dict]] = []
        self.evaluate = SimpleNamespace(remote=self._evaluate)

    def _evaluate(self, weights, **request) -> ray.ObjectRef:
        self.calls.append((ray.get(weights), request))
        return ray.put({"eval/return_mean": 0.0})


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same(evaluated: dict, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(torch.as_tensor(np.array(evaluated[k])), v) for k, v in weights.items())


def test_a_warmup_iteration_is_evaluated_with_its_own_weights(tmp_path, local_ray):
    train = {
        "num_iterations": 10,
        "batches_per_iteration": 1,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 1,
        "context_length": 8,
        "learning_rate": 1e-2,
        "vf_warmup": 1,
        "eval_interval": 1,
        "prefetch_batches": 0,
        "record_video_interval": 0,
        "save_interval": 1000,
    }
    trainer = TrainLoop(
        algorithm=PPOTrainer,
        rollout_manager=SimpleNamespace(update_weights=SimpleNamespace(remote=lambda *a, **k: None)),
        policy_generator=lambda: mlp_policy(hidden=16),
        env_generator=None,
        config=OnlineConfig(train_config=train, rollout_config={"fragment_length": 8}),
        run_dir=str(tmp_path),
    )
    trainer.setup_rank(local=True)
    evaluator = RecordingEvaluator()
    trainer._evaluation = EvaluationClient(start=lambda restart: evaluator, logger_hub=None)
    streams = rollout_fragments(trainer.policy, lambda i: cartpole(12), num_envs=2, fragment_length=8)
    trainer.fetch_chunks = lambda *args: assemble_chunks(chunks_of(streams, 1)[:2])

    published = _weights(trainer.policy)
    trainer._publish_weights()  # version 0, as training starts
    trainer.flush_broadcast()
    weights = {}
    for iteration in (1, 2):
        trainer.run_iteration(iteration)
        trainer.flush_broadcast()
        weights[iteration] = _weights(trainer.policy)
    trainer._evaluation.poll(wait=True)

    assert [request["iteration"] for _, request in evaluator.calls] == [1, 2]
    (warmup, warmup_request), (trained, trained_request) = evaluator.calls
    assert not trainer.algorithm.publishes_version(1) and trainer.algorithm.publishes_version(2)
    assert warmup_request["version"] == 0 and trained_request["version"] == 1
    assert not _same(warmup, published)  # the warm-up changed the weights: the broadcast's are stale
    assert _same(warmup, weights[1])
    assert _same(trained, weights[2])
