"""The trainer side: ``Algorithm`` (what plugins subclass), ``TrainLoop`` (Ray Train loop), GAE, checkpoints."""

from mineonline_core.trainer.algorithm import Algorithm, TrainContext, TrainerOptions, hook
from mineonline_core.trainer.base import BaseTrainer, build_loop
from mineonline_core.trainer.checkpoint import latest_checkpoint, load_checkpoint
from mineonline_core.trainer.gae import compute_gae
from mineonline_core.trainer.loop import TrainLoop
from mineonline_core.trainer.sequence import forward_sequence

__all__ = [
    "Algorithm",
    "BaseTrainer",
    "TrainContext",
    "TrainLoop",
    "TrainerOptions",
    "build_loop",
    "compute_gae",
    "forward_sequence",
    "hook",
    "latest_checkpoint",
    "load_checkpoint",
]
