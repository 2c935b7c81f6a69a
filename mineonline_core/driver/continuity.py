"""One curve across a resume: the env-step axis, ``metrics.jsonl`` and the wandb run carry on.

A checkpoint records the env-step count its iteration was logged at (``trainer.pt``). When a run
resumes from it, the driver first drops what the previous process logged *after* that checkpoint
(iterations that will be trained again, so the file never holds one iteration twice), then starts
the logging actor and sets its env-step counter to the checkpoint's, so the next point continues the
axis instead of restarting at 0. Loggers that keep a run of their own (wandb) store its id in the run
directory (``Logger.keep_run_id``, ``contracts/logger.py``) and reopen it on resume.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run picks up: the checkpoint's iteration and env-step count."""

    iteration: int
    env_steps: int


def resume_point(resume: str | os.PathLike[str]) -> ResumePoint:
    """The iteration and env steps of the checkpoint ``resume`` names (read without unpickling code)."""
    import torch

    from mineonline_core.trainer.checkpoint import resolve_resume

    state = torch.load(resolve_resume(resume) / "trainer.pt", map_location="cpu", weights_only=True)
    return ResumePoint(iteration=int(state["iteration"]), env_steps=int(state.get("env_steps", 0)))


def truncate_metrics(path: str | os.PathLike[str], point: ResumePoint) -> int:
    """Drop the records of ``metrics.jsonl`` logged after ``point``; return how many were dropped.

    A record is after the point when its step is past the checkpoint's env steps or it belongs to a
    later iteration. The file is replaced atomically; a half-written last line is dropped too.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            iteration = record.get("trainer/iteration")
            if record.get("step", 0) > point.env_steps or (iteration is not None and iteration > point.iteration):
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped
