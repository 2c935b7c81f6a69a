"""A pickle-free record format for payload trees.

A record is one **header** value plus N raw **parts**. The header is

* the prefix ``b"MOL3"``, the part count, the structure length and the values length (uint32 LE);
* the **structure**: JSON of the tree's shape, dtypes and offsets, with no per-record values, so
  that all fragments of a run share it and its validated form is cached (``plan.compile_plan``);
* the **values**: a JSON list of the Python scalars (bool, int, str; a float as ``[float.hex]``)
  in depth-first order;
* zero padding to a multiple of 8, then the **inline blob**: the raw bytes of every small array
  (``INLINE_MAX`` bytes or less), each at an 8-byte-aligned offset.

Every larger array (and every ``bytes`` leaf) is one part holding its raw C-ordered buffer, written
straight from the caller's memory. Structure nodes are tagged lists (see ``plan``). Decoding
validates every field against the bytes it is given, so a tampered record raises
``CorruptRecordError``; nothing is ever unpickled or evaluated. Decoded arrays of one record share
one fresh allocation: one copy per part and one for the whole inline blob.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

import numpy as np

from mineonline_lmdb.plan import (
    INLINE_ALIGN,
    MAX_DEPTH,
    CorruptRecordError,
    Plan,
    align,
    check_dtype,
    compile_plan,
)

__all__ = ["CorruptRecordError", "INLINE_MAX", "decode", "encode", "materialize", "parse_header", "raw_view"]

MAGIC = b"MOL3"
_PREFIX = struct.Struct("<4sIII")
# Arrays up to this size travel inside the header value: one LMDB value and one copy for all of them.
INLINE_MAX = 16 << 10


# -- encoding ---------------------------------------------------------------------------------------


def encode(payload: Any) -> tuple[bytes, list[np.ndarray | bytes]]:
    """``payload`` as (header, parts); parts alias the payload's own buffers where possible."""
    parts: list[np.ndarray | bytes] = []
    values: list[Any] = []
    blob = bytearray()
    tree = _encode_node(payload, parts, values, blob, 0)
    structure = json.dumps(tree, separators=(",", ":")).encode("ascii")
    scalars = json.dumps(values, separators=(",", ":")).encode("ascii")
    head = _PREFIX.pack(MAGIC, len(parts), len(structure), len(scalars)) + structure + scalars
    return head + bytes(align(len(head), INLINE_ALIGN) - len(head)) + blob, parts


# The recursive helpers are module functions, not closures: a recursive closure is a reference cycle
# that would keep every array of a record alive until the garbage collector runs, and fresh memory
# for each record costs more (page faults) than copying it.
def _encode_node(x: Any, parts: list, values: list, blob: bytearray, depth: int) -> list:
    if depth > MAX_DEPTH:
        raise ValueError(f"a replay payload is nested deeper than {MAX_DEPTH} levels")
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        check_dtype(arr.dtype)
        scalar = int(isinstance(x, np.generic))
        if arr.nbytes <= INLINE_MAX:
            offset = align(len(blob), INLINE_ALIGN)
            blob += bytes(offset - len(blob))
            if arr.nbytes:
                blob += memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
            return ["A", arr.dtype.str, list(arr.shape), offset, scalar]
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # the only copy of a large array on the write path
        parts.append(arr)
        return ["a", arr.dtype.str, list(arr.shape), len(parts) - 1, scalar]
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"a replay payload has a dict key {k!r} of type {type(k).__name__}; keys must be str")
        return ["d", list(x), [_encode_node(v, parts, values, blob, depth + 1) for v in x.values()]]
    if isinstance(x, tuple):
        return ["t", [_encode_node(v, parts, values, blob, depth + 1) for v in x]]
    if isinstance(x, list):
        return ["l", [_encode_node(v, parts, values, blob, depth + 1) for v in x]]
    if x is None:
        return ["n"]
    if isinstance(x, (bool, str)):
        values.append(x)
        return ["v"]
    if isinstance(x, int):
        values.append(int(x))
        return ["v"]
    if isinstance(x, float):
        values.append([float(x).hex()])
        return ["v"]
    if isinstance(x, (bytes, bytearray)):
        parts.append(bytes(x))
        return ["y", len(parts) - 1]
    raise TypeError(
        f"a replay payload holds a {type(x).__module__}.{type(x).__qualname__}; stores accept numpy "
        "arrays, dict/list/tuple, None, bool, int, float, str and bytes (convert tensors with "
        "mineonline_core.contracts.tree.to_numpy)."
    )


def raw_view(part: np.ndarray | bytes) -> Any:
    """A flat byte view of a part for writing (no copy)."""
    if isinstance(part, bytes):
        return part
    return part.reshape(-1).view(np.uint8)


# -- decoding ---------------------------------------------------------------------------------------


class Parsed(NamedTuple):
    """A parsed, validated header: its compiled structure, its scalar values and its inline blob
    (a view into the header value, valid as long as that value is)."""

    plan: Plan
    values: list[Any]
    blob: Any


def parse_header(header: bytes | memoryview) -> Parsed:
    """Parse and validate a header value; ``CorruptRecordError`` when it is not a valid record."""
    if len(header) < _PREFIX.size:
        raise CorruptRecordError(f"header of {len(header)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, count, structure_len, values_len = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise CorruptRecordError(f"header starts with {bytes(magic)!r}, expected {MAGIC!r}")
    start, middle = _PREFIX.size, _PREFIX.size + structure_len
    end = middle + values_len
    if end > len(header):
        raise CorruptRecordError(f"header announces {end} bytes of JSON, it holds {len(header)}")
    view = memoryview(header)
    plan = compile_plan(bytes(view[start:middle]))
    if plan.part_count != count:
        raise CorruptRecordError(f"header announces {count} parts, its structure uses {plan.part_count}")
    blob = view[align(end, INLINE_ALIGN) :]
    if len(blob) < plan.blob_len:
        raise CorruptRecordError(f"inline arrays need {plan.blob_len} bytes, the header holds {len(blob)}")
    return Parsed(plan, _values(view[middle:end], plan.value_count), blob)


def _values(raw: memoryview, count: int) -> list[Any]:
    try:
        values = json.loads(bytes(raw).decode("ascii")) if count else []
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecordError(f"header values are unreadable ({type(exc).__name__}: {exc})") from None
    if type(values) is not list or len(values) != count:
        raise CorruptRecordError(
            f"header holds {len(values) if type(values) is list else '?'} values, expected {count}"
        )
    for i, v in enumerate(values):
        if type(v) is list:
            if len(v) != 1 or type(v[0]) is not str:
                raise CorruptRecordError(f"value {i} is not a hex float")
            try:
                values[i] = float.fromhex(v[0])
            except ValueError:
                raise CorruptRecordError(f"value {i} ({v[0][:40]!r}) is not a hex float") from None
        elif type(v) not in (bool, int, str):
            raise CorruptRecordError(f"value {i} has type {type(v).__name__}")
    return values


def materialize(parsed: Parsed, buffers: list[Any]) -> Any:
    """The payload, copied out of the header's blob and the part ``buffers`` (which may be views into
    the database, valid only during a read transaction). All arrays share one allocation; a kept
    array keeps its record's allocation alive (copy it to keep a small piece of a large record)."""
    plan = parsed.plan
    if len(buffers) != plan.part_count:
        raise CorruptRecordError(f"{plan.part_count} parts expected, {len(buffers)} found")
    for index, _, nbytes in plan.part_copies:  # before allocating: sizes come from the header
        if len(buffers[index]) != nbytes:
            raise CorruptRecordError(f"part {index} needs {nbytes} bytes, it holds {len(buffers[index])}")
    arena = np.empty(plan.arena_len, dtype=np.uint8)
    if plan.blob_len:
        arena[: plan.blob_len] = np.frombuffer(parsed.blob[: plan.blob_len], dtype=np.uint8)
    for index, offset, nbytes in plan.part_copies:
        arena[offset : offset + nbytes] = np.frombuffer(buffers[index], dtype=np.uint8)
    leaves = plan.leaves(arena, buffers, parsed.values)
    return plan.assemble(leaves)


def decode(header: bytes | memoryview, buffers: list[Any]) -> Any:
    """Decode a record from its header value and its raw part buffers."""
    return materialize(parse_header(header), buffers)
