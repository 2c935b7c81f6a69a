"""The names of the columns of a fragment and a training batch, and of a policy's outputs, without torch.

``contracts/batch.py`` types them (dtypes, shapes, units); these names alone are what the bookkeeping actors
(the rollout manager, the replay buffer, the store host) need, and those never import torch (start-up).
"""

from __future__ import annotations


class Columns:
    """The name of every column of a fragment and of a training batch (``mineonline_core.contracts.fragment``
    keeps its module constants, ``F.OBS`` and the rest, as aliases of these)."""

    # Written by rollout, one per step (a fragment's, then a chunk's along time).
    OBS = "obs"
    ACTION = "action"
    REWARD = "reward"
    TERMINATED = "terminated"
    TRUNCATED = "truncated"
    FIRST = "first"
    LOGPROB = "logprob"
    VPRED = "vpred"
    BOOTSTRAP = "bootstrap"
    EPISODE_ID = "episode_id"
    VERSION = "version"
    REF_LOGITS = "ref_logits"  # optional: only where rollout ran the KL reference
    # Written by rollout, once per fragment (never sliced into windows).
    NEXT_OBS = "next_obs"
    STATE_IN = "state_in"
    REF_STATE_IN = "ref_state_in"
    STREAM = "stream"
    INDEX = "index"
    WORKER_ID = "worker_id"
    ENV_ID = "env_id"
    # Added by the trainer before the update (fetch, then ``estimate``).
    STALENESS = "staleness"
    VALUE = "value"
    ADVANTAGE = "advantage"
    RETURN = "return"
    LOGPROB_PROX = "logprob_prox"
    # Added by the update loop, in head units.
    OLD_VPRED = "old_vpred"
    VALUE_TARGET = "value_target"
    # Added under ``normalize_rewards`` (``contracts.normalize.RAW_REWARD``).
    REWARD_RAW = "reward_raw"


class Outputs:
    """The keys of ``compute_loss``'s ``outputs`` (and of a policy's latents: ``PI_LOGITS``, ``VPRED``)."""

    PI_LOGITS = "pi_logits"
    VPRED = "vpred"
    REF_LOGITS = "ref_logits"
