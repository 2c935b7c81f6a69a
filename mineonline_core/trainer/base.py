"""``BaseTrainer``: the trainer base class before ``Algorithm``, kept while plugins move.

A ``BaseTrainer`` subclass is its own loop and its own algorithm: its hooks read the loop's state as
attributes of ``self`` (``self.policy``, ``self.iteration``), as before. A new trainer subclasses
``Algorithm`` (``trainer/algorithm.py``) and reads that state from ``self.ctx``; moving one is a
one-line change of its base class plus ``self.X`` -> ``self.ctx.X`` for the loop's state
(``docs/plugins.md``). The conformance suite still refuses a ``BaseTrainer`` subclass that overrides
a method of the loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from mineonline_core.config.messages import validate_trainer_options
from mineonline_core.trainer.algorithm import Algorithm, TrainerOptions
from mineonline_core.trainer.loop import TrainLoop

__all__ = ["BaseTrainer", "TrainerOptions", "build_loop"]


class BaseTrainer(TrainLoop, Algorithm):
    """A loop whose algorithm is itself (see the module doc); takes ``TrainLoop``'s keywords."""

    def __init__(self, *, options: BaseModel | None = None, **loop: Any) -> None:
        valid = options if options is not None else validate_trainer_options(type(self), loop["config"].train_config)
        Algorithm.__init__(self, options=valid)
        TrainLoop.__init__(self, algorithm=self, options=valid, **loop)


def build_loop(trainer_cls: type[Algorithm], **loop: Any) -> TrainLoop:
    """The loop around ``trainer_cls`` (the class ``trainer_name`` selects), with ``TrainLoop``'s keywords;
    a ``BaseTrainer`` subclass is a loop already."""
    if issubclass(trainer_cls, TrainLoop):
        return trainer_cls(**loop)
    return TrainLoop(algorithm=trainer_cls, **loop)
