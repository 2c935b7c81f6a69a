"""Names of the columns of a fragment and of a training batch.

A **fragment** is ``fragment_length`` consecutive steps of one env, cut by a rollout worker. It is a
dict (a tree, see ``mineonline_core.contracts.tree``) with these keys; T is ``fragment_length``:

=================  ==========================================================================
``obs``            tree of arrays, leaves (T, ...): the observation the policy acted on
``next_obs``       tree of arrays, leaves (1, ...): the observation after the last step
``action``         tree of arrays, leaves (T, ...): what ``pi_head.sample`` returned
``reward``         float32 (T,)
``terminated``     bool (T,): the episode ended in a true terminal state (no bootstrap)
``truncated``      bool (T,): the episode was cut (time limit, env crash or hang): bootstrap
``first``          bool (T,): the step is the first of an episode (recurrent memory resets)
``logprob``        float32 (T,): the behaviour policy's log-prob of ``action``
``vpred``          float32 (T,): the behaviour policy's value, denormalised
``bootstrap``      float32 (T,): at truncated steps, the behaviour value of the final
                   observation (the value of the last observation for a crash); 0 elsewhere
``state_in``       the recurrent state before step 0, batch size 1 (None when feed-forward)
``ref_state_in``   the KL reference policy's own recurrent state before step 0 (None without one)
``episode_id``     int64 (T,): a per-stream episode counter
``version``        int64 (T,): the model version that chose each action
``stream``         str: ``"{worker_id}.{incarnation}.{env_id}"``, one per env per worker life
                   (``stream_name``; a store key is ``fragment_key(stream, index)``)
``index``          int: the fragment's position in its stream (consecutive fragments: +1)
``worker_id``      int
``env_id``         int
=================  ==========================================================================

A **chunk** is ``fragments_per_chunk`` consecutive fragments of one stream; it is what the replay
buffer serves and what the trainer trains on as one sequence.
"""

from __future__ import annotations

import zlib

import numpy as np

from mineonline_core.contracts.store import payload_nbytes

OBS = "obs"
NEXT_OBS = "next_obs"
ACTION = "action"
REWARD = "reward"
TERMINATED = "terminated"
TRUNCATED = "truncated"
FIRST = "first"
LOGPROB = "logprob"
VPRED = "vpred"
BOOTSTRAP = "bootstrap"
STATE_IN = "state_in"
REF_STATE_IN = "ref_state_in"
EPISODE_ID = "episode_id"
VERSION = "version"
STREAM = "stream"
INDEX = "index"
WORKER_ID = "worker_id"
ENV_ID = "env_id"

# Per-step columns, concatenated along time when fragments are chained into a chunk.
STEP_COLUMNS = (OBS, ACTION, REWARD, TERMINATED, TRUNCATED, FIRST, LOGPROB, VPRED, BOOTSTRAP, EPISODE_ID, VERSION)

# Columns the trainer adds to a batch (float32, (N, L)).
ADVANTAGE = "advantage"
RETURN = "return"
VALUE = "value"  # the trainer's own value estimate at fetch time, denormalised
# The trainer's version minus the version that chose each action, at fetch time (logged, never trained on).
STALENESS = "staleness"
# The current model's log-prob of the stored action at the start of the update, in the training
# numerics and micro-batch shapes: the proximal policy of PPO's decoupled objective.
LOGPROB_PROX = "logprob_prox"
# Added by the update loop, in the value head's normalised units (``use_normalized_vf``).
VALUE_TARGET = "value_target"  # ``return`` normalised: what the value head regresses
# The value head's own output at the start of the update (the current model's, from the estimate
# pass, taken before the normaliser moves): the centre of PPO's clipped value loss.
OLD_VPRED = "old_vpred"


def stream_name(worker_id: int, incarnation: int, env_id: int) -> str:
    """A stream's name: ``"{worker_id}.{incarnation}.{env_id}"``, one per env per worker life, so a
    restarted worker (a new incarnation) never writes a key an earlier life wrote."""
    return f"{worker_id}.{incarnation}.{env_id}"


def parse_stream(stream: str) -> tuple[int, int, int] | None:
    """``stream_name``'s inverse: ``(worker_id, incarnation, env_id)``, or None for a stream a worker
    did not name (tests store under free-form streams)."""
    parts = stream.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    worker_id, incarnation, env_id = (int(part) for part in parts)
    return worker_id, incarnation, env_id


def fragment_key(stream: str, index: int) -> str:
    """The store key of a fragment: sortable within a stream."""
    return f"{stream}.{index:09d}"


def parse_fragment_key(key: str) -> tuple[str, int] | None:
    """``fragment_key``'s inverse: ``(stream, index)``, or None for a key no fragment has."""
    stream, _, index = key.rpartition(".")
    if not stream or not index.isdigit():
        return None
    return stream, int(index)


def fragment_checksum(key: str, fragment: dict) -> int:
    """crc32 of the key, rewards and behaviour log-probs: enough to detect a swapped or torn payload."""
    crc = zlib.crc32(key.encode())
    crc = zlib.crc32(np.ascontiguousarray(fragment[REWARD], np.float32).tobytes(), crc)
    return zlib.crc32(np.ascontiguousarray(fragment[LOGPROB], np.float32).tobytes(), crc)


def fragment_meta(fragment: dict) -> dict:
    """What a rollout worker tells the replay buffer of a fragment it stored (the payload stays in the store)."""
    key = fragment_key(fragment[STREAM], fragment[INDEX])
    return {
        "key": key,
        "stream": fragment[STREAM],
        "index": int(fragment[INDEX]),
        "version": int(np.min(fragment[VERSION])),
        "steps": int(len(fragment[REWARD])),
        "checksum": fragment_checksum(key, fragment),
        "nbytes": payload_nbytes(fragment),
    }
