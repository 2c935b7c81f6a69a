"""The trainer side: ``BaseTrainer`` (Ray Train loop), GAE, sequence forwards and checkpoints."""

from mineonline_core.trainer.base import BaseTrainer, TrainerOptions
from mineonline_core.trainer.checkpoint import latest_checkpoint, load_checkpoint
from mineonline_core.trainer.gae import compute_gae
from mineonline_core.trainer.sequence import forward_sequence

__all__ = ["BaseTrainer", "TrainerOptions", "compute_gae", "forward_sequence", "latest_checkpoint", "load_checkpoint"]
