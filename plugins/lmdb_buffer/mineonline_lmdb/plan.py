"""Validated, cached record structures ("plans") for ``codec``.

A structure is JSON of tagged lists:

====================================  =======================================================
``["d", [keys...], [nodes...]]``      dict with string keys, insertion order kept
``["l", [nodes...]]``                 list
``["t", [nodes...]]``                 tuple
``["n"]``                             None
``["v"]``                             the next Python scalar of the record's values list
``["y", part]``                       Python bytes, stored as a part
``["a", dtype, shape, part, 0|1]``    numpy array stored as a part (1: a numpy scalar)
``["A", dtype, shape, offset, 0|1]``  numpy array in the header's inline blob
====================================  =======================================================

Fragments of one run share their structure, so ``compile_plan`` validates each distinct structure
once and keeps the result: the arena layout (where each array lands in the record's one
allocation) and the leaves in depth-first order. Decoding a record is then: copy the blob and the
parts into the arena, make one array view per leaf, and put the leaves back into the tree.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import numpy as np

from mineonline_core.errors import MineOnlineError

INLINE_ALIGN = 8
PART_ALIGN = 64
# A nesting limit keeps a hostile header from exhausting the stack of the decoding process.
MAX_DEPTH = 64
_MAX_DIM = 2**62
_ARRAY, _BYTES, _VALUE = 0, 1, 2


class CorruptRecordError(MineOnlineError):
    """A stored record is not a valid mineonline record (damaged, or written by something else)."""


def align(n: int, to: int) -> int:
    return -(-n // to) * to


def check_dtype(dtype: np.dtype) -> None:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(
            f"a replay payload holds an array of dtype {dtype!r}; only plain numeric, bool, string "
            "and datetime dtypes can be stored without pickle. Convert it (np.asarray(x, np.float32)) "
            "or split structured arrays into one array per field."
        )


class Plan:
    """A validated structure: arena layout, leaves in depth-first order, and the tree to refill."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.value_count = 0
        self.blob_len = 0
        self._parts: dict[int, tuple[np.dtype, tuple[int, ...]] | None] = {}
        self._specs: list[list] = []  # one per leaf: [kind, a, b, c, d, part index of an array part]
        _walk(tree, self, 0)
        if sorted(self._parts) != list(range(len(self._parts))):
            raise CorruptRecordError(f"part indices {sorted(self._parts)[:8]} are not 0..N-1")
        self.part_count = len(self._parts)
        # Arena: the inline blob first, then each array part at a 64-byte-aligned offset.
        offset = align(self.blob_len, PART_ALIGN)
        part_offsets: dict[int, int] = {}
        self.part_copies: list[tuple[int, int, int]] = []
        for index in range(self.part_count):
            spec = self._parts[index]
            if spec is not None:
                nbytes = math.prod(spec[1]) * spec[0].itemsize
                part_offsets[index] = offset
                self.part_copies.append((index, offset, nbytes))
                offset += align(nbytes, PART_ALIGN)
        self.arena_len = offset
        for spec in self._specs:
            if spec[0] == _ARRAY and spec[5] is not None:  # a part array: its offset is known now
                spec[3] = part_offsets[spec[5]]
        self.leaf_specs = [tuple(spec[:5]) for spec in self._specs]
        del self._specs

    def leaves(self, arena: np.ndarray, buffers: list[Any], values: list[Any]) -> list[Any]:
        """The record's leaves, in depth-first order: views into ``arena``, bytes and scalars."""
        out: list[Any] = []
        for kind, a, b, c, d in self.leaf_specs:
            if kind == _ARRAY:  # a: dtype, b: shape, c: offset (None when empty), d: numpy scalar
                arr = np.empty(b, a) if c is None else np.ndarray(b, a, buffer=arena, offset=c)
                out.append(arr[()] if d else arr)
            elif kind == _BYTES:
                out.append(bytes(buffers[a]))
            else:
                out.append(values[a])
        return out

    def assemble(self, leaves: list[Any]) -> Any:
        return _fill(self.tree, iter(leaves))


@functools.lru_cache(maxsize=256)
def compile_plan(structure: bytes) -> Plan:
    """The validated plan of a structure's JSON bytes; ``CorruptRecordError`` when it is invalid."""
    try:
        tree = json.loads(structure.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecordError(f"header structure is unreadable ({type(exc).__name__}: {exc})") from None
    return Plan(tree)


@functools.lru_cache(maxsize=512)
def _dtype(text: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
        check_dtype(dtype)
    except TypeError as exc:
        raise CorruptRecordError(f"array node has an unacceptable dtype {text[:40]!r} ({exc})") from None
    return dtype


def _array(n: list) -> tuple[np.dtype, tuple[int, ...], int]:
    if len(n) != 5 or not isinstance(n[1], str) or not isinstance(n[2], list) or n[4] not in (0, 1):
        raise CorruptRecordError(f"malformed array node {str(n)[:80]!r}")
    shape = n[2]
    if len(shape) > 64 or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        raise CorruptRecordError(f"array node has an invalid shape {str(shape)[:80]}")
    if n[4] == 1 and shape:
        raise CorruptRecordError("a numpy-scalar node has a non-empty shape")
    dtype = _dtype(n[1])
    return dtype, tuple(shape), math.prod(shape) * dtype.itemsize


def _claim(plan: Plan, index: Any, spec: tuple[np.dtype, tuple[int, ...]] | None) -> None:
    if type(index) is not int or index in plan._parts or not 0 <= index < 2**31:
        raise CorruptRecordError(f"part index {index!r} is invalid or used twice")
    plan._parts[index] = spec


def _walk(n: Any, plan: Plan, depth: int) -> None:
    if depth > MAX_DEPTH or not isinstance(n, list) or not n or not isinstance(n[0], str):
        raise CorruptRecordError(f"malformed node {str(n)[:80]!r}")
    tag = n[0]
    if tag == "A":
        dtype, shape, nbytes = _array(n)
        offset = n[3]
        if type(offset) is not int or not 0 <= offset < 2**40 or offset % INLINE_ALIGN:
            raise CorruptRecordError(f"inline array offset {offset!r} is invalid")
        plan.blob_len = max(plan.blob_len, offset + nbytes)
        plan._specs.append([_ARRAY, dtype, shape, offset if nbytes else None, n[4], None])
    elif tag == "a":
        dtype, shape, nbytes = _array(n)
        _claim(plan, n[3], (dtype, shape))
        # The offset is filled in once the arena is laid out; None stays for an empty array.
        plan._specs.append([_ARRAY, dtype, shape, None, n[4], n[3] if nbytes else None])
    elif tag == "y":
        if len(n) != 2:
            raise CorruptRecordError(f"malformed bytes node {str(n)[:80]!r}")
        _claim(plan, n[1], None)
        plan._specs.append([_BYTES, n[1], None, None, None, None])
    elif tag == "v":
        if len(n) != 1:
            raise CorruptRecordError("malformed value node")
        plan._specs.append([_VALUE, plan.value_count, None, None, None, None])
        plan.value_count += 1
    elif tag == "d":
        if len(n) != 3 or not isinstance(n[1], list) or not isinstance(n[2], list) or len(n[1]) != len(n[2]):
            raise CorruptRecordError("malformed dict node")
        if not all(isinstance(k, str) for k in n[1]):
            raise CorruptRecordError("dict node has a non-string key")
        for child in n[2]:
            _walk(child, plan, depth + 1)
    elif tag in ("l", "t"):
        if len(n) != 2 or not isinstance(n[1], list):
            raise CorruptRecordError(f"malformed {tag} node")
        for child in n[1]:
            _walk(child, plan, depth + 1)
    elif tag == "n":
        if len(n) != 1:
            raise CorruptRecordError("malformed None node")
    else:
        raise CorruptRecordError(f"unknown node tag {tag[:20]!r}")


def _fill(n: list, leaves: Any) -> Any:
    tag = n[0]
    if tag == "d":
        return {k: _fill(v, leaves) for k, v in zip(n[1], n[2])}
    if tag == "l":
        return [_fill(v, leaves) for v in n[1]]
    if tag == "t":
        return tuple([_fill(v, leaves) for v in n[1]])
    if tag == "n":
        return None
    return next(leaves)  # A, a, y, v: the next leaf in depth-first order
