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
``ref_logits``     tree like ``pi_logits``, leaves float32 (T, ...): the KL reference's logits at each step,
                   computed beside the behaviour policy at rollout (absent without a reference, and in
                   stores written before this column: training then runs the reference itself)
``episode_id``     int64 (T,): a per-stream episode counter
``version``        int64 (T,): the model version that chose each action
``stream``         str: ``"{worker_id}.{incarnation}.{env_id}"``, one per env per worker life
                   (``stream_name``; a store key is ``fragment_key(stream, index)``)
``index``          int: the fragment's position in its stream (consecutive fragments: +1)
``worker_id``      int
``env_id``         int
``checksum``       the record's own checksums, ``{"rule": 2, "columns": {name: crc32}}`` over every other
                   key (``seal``, by ``fragment_meta`` before the worker's write; checked by
                   ``verify_fragment`` at the trainer's fetch). Absent from stores written before it
=================  ==========================================================================

A **chunk** is ``fragments_per_chunk`` consecutive fragments of one stream; it is what the replay
buffer serves and what the trainer trains on as one sequence.
"""

from __future__ import annotations

import zlib

import numpy as np

from mineonline_core.contracts.columns import Columns
from mineonline_core.contracts.store import payload_nbytes

# The column names, declared once in ``contracts.batch.Columns`` (with the batch's dtypes, shapes and units).
OBS = Columns.OBS
NEXT_OBS = Columns.NEXT_OBS
ACTION = Columns.ACTION
REWARD = Columns.REWARD
TERMINATED = Columns.TERMINATED
TRUNCATED = Columns.TRUNCATED
FIRST = Columns.FIRST
LOGPROB = Columns.LOGPROB
VPRED = Columns.VPRED
BOOTSTRAP = Columns.BOOTSTRAP
STATE_IN = Columns.STATE_IN
REF_STATE_IN = Columns.REF_STATE_IN
REF_LOGITS = Columns.REF_LOGITS
EPISODE_ID = Columns.EPISODE_ID
VERSION = Columns.VERSION
STREAM = Columns.STREAM
INDEX = Columns.INDEX
WORKER_ID = Columns.WORKER_ID
ENV_ID = Columns.ENV_ID

# Per-step columns, concatenated along time when fragments are chained into a chunk.
STEP_COLUMNS = (OBS, ACTION, REWARD, TERMINATED, TRUNCATED, FIRST, LOGPROB, VPRED, BOOTSTRAP, EPISODE_ID, VERSION)
# Per-step columns a fragment may lack (concatenated like the others when every fragment of a chunk has them).
OPTIONAL_STEP_COLUMNS = (REF_LOGITS,)

# Columns the trainer adds to a batch (float32, (N, L)): see ``contracts.batch`` for what each holds.
ADVANTAGE = Columns.ADVANTAGE
RETURN = Columns.RETURN
VALUE = Columns.VALUE
STALENESS = Columns.STALENESS
LOGPROB_PROX = Columns.LOGPROB_PROX
VALUE_TARGET = Columns.VALUE_TARGET
OLD_VPRED = Columns.OLD_VPRED


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


# The record's own checksums, written into the payload by ``seal`` (``fragment_meta`` seals what a worker writes).
CHECKSUM = "checksum"
CHECKSUM_RULE = 2  # rule 1: records without ``CHECKSUM`` (stores written before it), see ``verify_fragment``
# Columns whose every value must be finite: the env pool never writes a non-finite one (services/finite.py).
FINITE_COLUMNS = (REWARD, LOGPROB, VPRED, BOOTSTRAP)


def _crc(x: object, crc: int) -> int:
    """crc32 of a payload tree: every container's kind, keys and length, every array's dtype, shape and
    raw bytes, every scalar's type and value, so that no two distinct trees share their input bytes."""
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)  # keeps a 0-d array 0-d, where ascontiguousarray makes it (1,)
        tag = f"{'s' if isinstance(x, np.generic) else 'a'}{arr.dtype.str}{arr.shape}"
        return zlib.crc32(arr if arr.flags.c_contiguous else arr.copy(), zlib.crc32(tag.encode(), crc))
    if isinstance(x, dict):
        crc = zlib.crc32(f"d{len(x)}".encode(), crc)
        for k in sorted(x, key=str):
            crc = _crc(x[k], zlib.crc32(f"k{len(str(k))}:{k}".encode(), crc))
        return crc
    if isinstance(x, (list, tuple)):
        crc = zlib.crc32(f"{'l' if isinstance(x, list) else 't'}{len(x)}".encode(), crc)
        for item in x:
            crc = _crc(item, crc)
        return crc
    if x is None:
        return zlib.crc32(b"n", crc)
    if isinstance(x, (bool, int, str)):
        return zlib.crc32(f"{type(x).__name__}{len(str(x))}:{x}".encode(), crc)
    if isinstance(x, float):
        return zlib.crc32(f"f{x.hex()}".encode(), crc)
    if isinstance(x, (bytes, bytearray)):
        return zlib.crc32(bytes(x), zlib.crc32(f"y{len(x)}".encode(), crc))
    return _crc(np.asarray(x), crc)  # a CPU tensor or the like: hashed as the array it converts to


def column_checksums(fragment: dict) -> dict[str, int]:
    """crc32 of each column of ``fragment`` (every key but ``CHECKSUM``, None and optional columns included),
    so that a column added to the fragment is covered without a change here."""
    return {name: _crc(value, 0) for name, value in sorted(fragment.items()) if name != CHECKSUM}


def seal(fragment: dict) -> dict:
    """Write ``fragment``'s checksum record into it (``CHECKSUM``: the rule and ``column_checksums``) and
    return it: stored with the payload, it lets a reader recompute and compare every column."""
    fragment[CHECKSUM] = {"rule": CHECKSUM_RULE, "columns": column_checksums(fragment)}
    return fragment


def _legacy_checksum(key: str, fragment: dict) -> int:
    crc = zlib.crc32(key.encode())
    crc = zlib.crc32(np.ascontiguousarray(fragment[REWARD], np.float32).tobytes(), crc)
    return zlib.crc32(np.ascontiguousarray(fragment[LOGPROB], np.float32).tobytes(), crc)


def fragment_checksum(key: str, fragment: dict) -> int:
    """The checksum the replay buffer keeps for ``key`` (``fragment_meta``), to compare at read.

    A sealed fragment's is the crc32 of the key and its *stored* column checksums (no bulk hashing: the
    buffer's rebuild at resume reads it cheaply); ``verify_fragment`` recomputes the columns. A fragment
    written before sealing existed (rule 1) gets the old rule: crc32 of the key, rewards and log-probs."""
    sealed = fragment.get(CHECKSUM)
    if sealed is None:
        return _legacy_checksum(key, fragment)
    columns = sealed.get("columns") if isinstance(sealed, dict) else None
    crc = zlib.crc32(f"{key}\0{sealed.get('rule') if isinstance(sealed, dict) else sealed!r}".encode())
    for name, value in sorted(columns.items()) if isinstance(columns, dict) else ():
        crc = zlib.crc32(f"\0{name}={value}".encode(), crc)
    return crc


def domain_problems(fragment: dict, version: int | None = None) -> list[str]:
    """What in ``fragment`` lies outside its column's domain: a version below 0 or above ``version`` (the
    version it is trained at: a negative staleness), a NaN or infinity where the env pool writes none."""
    problems = []
    versions = np.asarray(fragment.get(VERSION, ()))
    if versions.size and versions.dtype.kind not in "iu":
        problems.append(f"version has dtype {versions.dtype}, not an integer one")
    elif versions.size:
        low, high = versions.min(), versions.max()
        if low < 0:
            problems.append(f"version {low} is negative")
        if version is not None and high > version:
            problems.append(
                f"version {high} is above the trainer's {version} (a negative staleness: written by newer weights, "
                "as after a resume from an older checkpoint, or garbled)"
            )
    for column in FINITE_COLUMNS:
        values = np.asarray(fragment.get(column, ()))
        if values.dtype.kind in "fc" and not np.isfinite(values).all():
            problems.append(f"{column} holds {values.size - np.count_nonzero(np.isfinite(values))} non-finite values")
    return problems


def verify_fragment(
    key: str, fragment: object, *, checksum: int | None = None, version: int | None = None
) -> list[str]:
    """Why the payload read under ``key`` must not be trained on (empty when it may be).

    A sealed record (rule 2) is refused when a column's recomputed checksum differs from the one written
    with it, when a column appeared or vanished, when it holds another key's fragment, or when ``checksum``
    (what its writer told the buffer) differs from ``fragment_checksum``. A record without ``CHECKSUM`` was
    written before sealing (an older store a run resumes from): it is checked by the old rule, key, rewards
    and log-probs, against ``checksum``. Both are held to ``domain_problems`` at ``version``."""
    if not isinstance(fragment, dict):
        return [f"the payload is a {type(fragment).__name__}, not a fragment"]
    problems = []
    sealed = fragment.get(CHECKSUM)
    if sealed is not None:
        written = sealed.get("columns") if isinstance(sealed, dict) else None
        if not isinstance(written, dict) or sealed.get("rule") != CHECKSUM_RULE:
            problems.append(f"its checksum record is not of rule {CHECKSUM_RULE}: {str(sealed)[:80]}")
        else:
            now = column_checksums(fragment)
            differ = sorted(name for name in written.keys() | now.keys() if written.get(name) != now.get(name))
            if differ:
                problems.append(f"column(s) {', '.join(differ)} differ from the checksums written with them")
    stream, index = fragment.get(STREAM), fragment.get(INDEX)
    if isinstance(stream, str) and isinstance(index, int) and fragment_key(stream, index) != key:
        problems.append(f"it holds fragment {fragment_key(stream, index)}")
    try:
        if checksum is not None and fragment_checksum(key, fragment) != checksum:
            problems.append("its checksum differs from the one its writer reported")
    except (KeyError, TypeError, ValueError) as exc:
        problems.append(f"its checksum cannot be computed ({type(exc).__name__}: {exc})")
    return problems + domain_problems(fragment, version)


def fragment_meta(fragment: dict) -> dict:
    """What a rollout worker tells the replay buffer of a fragment it stores; ``seal``s the fragment first,
    so that the payload it writes carries its checksums (the payload stays in the store)."""
    key = fragment_key(fragment[STREAM], fragment[INDEX])
    seal(fragment)
    return {
        "key": key,
        "stream": fragment[STREAM],
        "index": int(fragment[INDEX]),
        "version": int(np.min(fragment[VERSION])),
        "steps": len(fragment[REWARD]),
        "checksum": fragment_checksum(key, fragment),
        "nbytes": payload_nbytes(fragment),
    }
