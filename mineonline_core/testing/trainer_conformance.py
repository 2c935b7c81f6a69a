"""The trainer conformance suite: a trainer plugin, driven through the core's own update loop.

A trainer plugin tests itself with a small subclass::

    class TestMyTrainer(TrainerConformance):
        trainer_cls = MyTrainer
        trainer_options = {"my_coef": 0.1}   # its own train_config keys, if any

On real CartPole fragments from a step-by-step rollout of the core's MLP policy, the suite checks
that the class is an ``Algorithm`` with a ``name`` and a pydantic ``Config`` whose keys are
described, that it overrides only the methods marked ``@hook`` (``unmarked_overrides``), that an unknown key is refused naming the key, the trainer and the closest key, that
``estimate`` fills its columns, that ``compute_loss`` returns a finite scalar loss with a
gradient and scalar metrics per window, and that one iteration through the core's loop (epochs,
micro-batches, BPTT windows, accumulation) updates the policy and logs only finite, namespaced
``trainer/`` metrics; and that ``has_reference`` agrees with the KL reference a rank builds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel

from mineonline_core.config import OnlineConfig
from mineonline_core.config.messages import validate_trainer_options
from mineonline_core.contracts import fragment as F
from mineonline_core.driver.resolve import check_overrides
from mineonline_core.errors import ConfigError
from mineonline_core.testing.kit import cartpole, chunks_of, mlp_policy, rollout_fragments
from mineonline_core.trainer.algorithm import Algorithm
from mineonline_core.trainer.base import build_loop
from mineonline_core.trainer.batch import assemble_chunks
from mineonline_core.trainer.loop import TrainLoop

FRAGMENT, PER_CHUNK, CONTEXT = 8, 2, 5  # windows of 5 steps over chunks of 16: the last one is short


class TrainerConformance:
    trainer_cls: ClassVar[type[Algorithm]]
    #: The trainer's own ``train_config`` keys for the suite's runs (validated by its ``Config``).
    trainer_options: ClassVar[dict[str, Any]] = {}

    # -- helpers ----------------------------------------------------------------------------

    def make_trainer(self, tmp_path: Path, **train: Any) -> TrainLoop:
        """The core's loop around the trainer, set up as one local CPU rank: 2 micro-batches of 2 chunks per step, 2 epochs."""
        train = {
            "num_iterations": 3,
            "batches_per_iteration": 2,
            "batch_size_per_gpu": 2,
            "gradient_accumulation": 2,
            "epochs_per_iteration": 2,
            "context_length": CONTEXT,
            "learning_rate": 1e-2,
            "discount": 0.9,
            "max_grad_norm": 1e3,
            **self.trainer_options,
            **train,
        }
        config = OnlineConfig(
            trainer_name=self.trainer_cls.name,
            train_config=train,
            rollout_config={"fragment_length": FRAGMENT, "replay_buffer_config": {"fragments_per_chunk": PER_CHUNK}},
        )
        trainer = build_loop(
            self.trainer_cls,
            rollout_manager=None,
            policy_generator=mlp_policy,
            env_generator=None,
            config=config,
            run_dir=str(tmp_path),
        )
        trainer.setup_rank(local=True)
        trainer.iteration = 1
        return trainer

    def make_batch(self, trainer: TrainLoop) -> dict[str, Any]:
        """Four chunks of real CartPole fragments (episodes end inside them), through ``estimate``."""
        streams = rollout_fragments(
            trainer.policy, lambda i: cartpole(12), num_envs=2, fragment_length=FRAGMENT, fragments_per_env=4
        )
        batch = assemble_chunks(chunks_of(streams, PER_CHUNK))
        batch[F.STALENESS] = (trainer.version - batch[F.VERSION]).float()
        return trainer.algorithm.estimate(batch=batch)

    # -- the suite --------------------------------------------------------------------------

    def test_is_a_base_trainer_with_a_name_and_a_described_config(self) -> None:
        cls = self.trainer_cls
        assert isinstance(cls, type) and issubclass(cls, Algorithm), "subclass mineonline_core.Algorithm"
        assert isinstance(cls.name, str) and cls.name, "set the class attribute `name`: it is what trainer_name selects"
        assert isinstance(cls.Config, type) and issubclass(cls.Config, BaseModel), "set `Config` to a pydantic model"
        assert cls.Config.model_config.get("extra") == "forbid", "Config must refuse unknown keys (extra='forbid')"
        undocumented = [k for k, info in cls.Config.model_fields.items() if not info.description]
        assert not undocumented, (
            f"give every Config key a Field description (`mineonline config docs` shows it): {undocumented}"
        )
        assert isinstance(
            validate_trainer_options(cls, OnlineConfig(train_config=self.trainer_options).train_config), cls.Config
        )

    def test_overrides_only_the_marked_hooks(self) -> None:
        # A method of the loop (or of Algorithm's own, unmarked) redefined here is never called as the plugin
        # expects, or replaces the core's machinery: either way the class's author meant a hook. A run
        # refuses such a class before Ray starts, with this message.
        check_overrides(self.trainer_cls)

    def test_an_unknown_key_names_the_key_the_trainer_and_the_closest_key(self) -> None:
        known = next(iter(self.trainer_cls.Config.model_fields), "learning_rate")
        typo = known[:-1] + ("x" if known[-1] != "x" else "y")
        train_config = OnlineConfig(train_config={**self.trainer_options, typo: 1}).train_config
        with pytest.raises(ConfigError) as info:
            validate_trainer_options(self.trainer_cls, train_config)
        message = str(info.value)
        assert f"train_config.{typo}" in message and repr(self.trainer_cls.name) in message and repr(known) in message

    def test_has_reference_says_whether_the_rank_keeps_one(self, tmp_path: Path) -> None:
        # The pre-Ray memory estimate sizes the reference's weights and per-fragment state from has_reference.
        trainer = self.make_trainer(tmp_path)
        assert (trainer.reference is not None) == self.trainer_cls.has_reference(trainer.options), (
            "has_reference(options) must say whether the rank keeps a KL reference (ctx.reference)"
        )

    def test_estimate_fills_advantage_return_and_value(self, tmp_path: Path) -> None:
        trainer = self.make_trainer(tmp_path)
        batch = self.make_batch(trainer)
        shape = batch[F.REWARD].shape
        for column in (F.ADVANTAGE, F.RETURN, F.VALUE):
            assert batch[column].shape == shape and bool(torch.isfinite(batch[column]).all()), column

    def test_compute_loss_is_a_finite_scalar_with_scalar_metrics(self, tmp_path: Path) -> None:
        trainer = self.make_trainer(tmp_path)
        calls: list[tuple[dict, torch.Tensor, dict]] = []
        compute_loss = trainer.algorithm.compute_loss

        def recording(*, batch: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
            loss, metrics = compute_loss(batch=batch, outputs=outputs)
            calls.append((batch, loss, metrics))
            return loss, metrics

        trainer.algorithm.compute_loss = recording
        trainer.train(self.make_batch(trainer))
        # 2 epochs x 2 micro-batches x ceil(16 / 5) windows, each (2 chunks, <= 5 steps).
        assert len(calls) == 2 * 2 * math.ceil(FRAGMENT * PER_CHUNK / CONTEXT)
        for batch, loss, metrics in calls:
            assert batch[F.REWARD].shape[0] == 2 and batch[F.REWARD].shape[1] <= CONTEXT
            assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and bool(torch.isfinite(loss)), loss
            assert loss.requires_grad, "the loss must depend on the policy's outputs"
            for key, value in metrics.items():
                assert "/" not in key, f"metric {key!r}: return it unprefixed, the core logs it as trainer/{key}"
                assert torch.as_tensor(value).numel() == 1 and math.isfinite(float(value)), (key, value)

    def test_one_iteration_through_the_core_loop_updates_the_policy(self, tmp_path: Path) -> None:
        trainer = self.make_trainer(tmp_path)
        before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
        batch = self.make_batch(trainer)
        returned: set[str] = set()
        compute_loss = trainer.algorithm.compute_loss

        def recording(*, batch: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
            loss, metrics = compute_loss(batch=batch, outputs=outputs)
            returned.update(metrics)
            return loss, metrics

        trainer.algorithm.compute_loss = recording
        metrics = {**trainer.train(batch), **trainer.algorithm.iteration_metrics()}
        moved = [k for k, v in trainer.policy.named_parameters() if not torch.equal(before[k], v.detach())]
        assert moved, "one iteration changed no parameter of the policy"
        assert {f"trainer/{k}" for k in returned} | {"trainer/grad_norm"} <= set(metrics)
        for key, value in metrics.items():
            assert key.startswith("trainer/"), f"metric {key!r} is not namespaced trainer/..."
            assert math.isfinite(float(value)), (key, value)
        assert metrics["trainer/grad_norm"] > 0 and trainer.update_guard.skipped_total == 0
