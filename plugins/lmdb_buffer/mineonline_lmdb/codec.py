"""A pickle-free record format for payload trees.

A record is one **header** value plus N raw **parts**. The header is the prefix ``b"MOL2"``, the
part count and the JSON length (two uint32, little-endian), a JSON description of the tree, zero
padding to a multiple of 8 bytes, then the **inline blob**: the raw bytes of every small array
(``INLINE_MAX`` bytes or less), each at an 8-byte-aligned offset. Every larger array (and every
``bytes`` leaf) is one part holding its raw C-ordered buffer, written straight from the caller's
memory. JSON nodes are tagged lists:

====================================  =======================================================
``["d", [keys...], [nodes...]]``      dict with string keys, insertion order kept
``["l", [nodes...]]``                 list
``["t", [nodes...]]``                 tuple
``["n"]``                             None
``["b", true]``                       Python bool
``["i", 12]``                         Python int (any size)
``["f", "0x1.8p+1"]``                 Python float, as ``float.hex`` so every bit survives
``["s", "text"]``                     Python str
``["y", part]``                       Python bytes
``["a", dtype, shape, part, 0|1]``    numpy array in a part (1: a numpy scalar, ``np.float32(1)``)
``["A", dtype, shape, offset, 0|1]``  numpy array in the inline blob
====================================  =======================================================

Decoding validates every field against the bytes it is given, so a tampered record raises
``CorruptRecordError``; nothing is ever unpickled or evaluated. Decoded arrays of one record share
one fresh allocation (one copy per part, one for the whole inline blob).
"""

from __future__ import annotations

import functools
import json
import math
import struct
from typing import Any, NamedTuple

import numpy as np

from mineonline_core.errors import MineOnlineError

MAGIC = b"MOL2"
_PREFIX = struct.Struct("<4sII")
# Arrays up to this size travel inside the header value: one LMDB value and one copy for all of them.
INLINE_MAX = 16 << 10
_INLINE_ALIGN = 8
_PART_ALIGN = 64
# A nesting limit keeps a hostile header from exhausting the stack of the decoding process.
MAX_DEPTH = 64
_MAX_DIM = 2**62
_SCALAR_TYPES = {"b": bool, "i": int, "s": str, "f": str}


class CorruptRecordError(MineOnlineError):
    """A stored record is not a valid mineonline record (damaged, or written by something else)."""


def _check_dtype(dtype: np.dtype) -> None:
    if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(
            f"a replay payload holds an array of dtype {dtype!r}; only plain numeric, bool, string "
            "and datetime dtypes can be stored without pickle. Convert it (np.asarray(x, np.float32)) "
            "or split structured arrays into one array per field."
        )


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# -- encoding ---------------------------------------------------------------------------------------


def encode(payload: Any) -> tuple[bytes, list[np.ndarray | bytes]]:
    """``payload`` as (header, parts); parts alias the payload's own buffers where possible."""
    parts: list[np.ndarray | bytes] = []
    blob = bytearray()
    tree = _encode_node(payload, parts, blob, 0)
    text = json.dumps(tree, separators=(",", ":")).encode("ascii")
    head = _PREFIX.pack(MAGIC, len(parts), len(text)) + text
    return head + bytes(_align(len(head), _INLINE_ALIGN) - len(head)) + blob, parts


# The recursive helpers are module functions, not closures: a recursive closure is a reference cycle
# that would keep every array of a record alive until the garbage collector runs, and fresh memory
# for each record costs more (page faults) than copying it.
def _encode_node(x: Any, parts: list, blob: bytearray, depth: int) -> list:
    if depth > MAX_DEPTH:
        raise ValueError(f"a replay payload is nested deeper than {MAX_DEPTH} levels")
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        _check_dtype(arr.dtype)
        scalar = int(isinstance(x, np.generic))
        if arr.nbytes <= INLINE_MAX:
            offset = _align(len(blob), _INLINE_ALIGN)
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
        return ["d", list(x), [_encode_node(v, parts, blob, depth + 1) for v in x.values()]]
    if isinstance(x, tuple):
        return ["t", [_encode_node(v, parts, blob, depth + 1) for v in x]]
    if isinstance(x, list):
        return ["l", [_encode_node(v, parts, blob, depth + 1) for v in x]]
    if x is None:
        return ["n"]
    if isinstance(x, bool):
        return ["b", x]
    if isinstance(x, int):
        return ["i", int(x)]
    if isinstance(x, float):
        return ["f", float(x).hex()]
    if isinstance(x, str):
        return ["s", x]
    if isinstance(x, (bytes, bytearray)):
        parts.append(bytes(x))
        return ["y", len(parts) - 1]
    raise TypeError(
        f"a replay payload holds a {type(x).__module__}.{type(x).__qualname__}; stores accept numpy "
        "arrays, dict/list/tuple, None, bool, int, float, str and bytes (convert tensors with "
        "mineonline_core.tree.to_numpy)."
    )


def raw_view(part: np.ndarray | bytes) -> Any:
    """A flat byte view of a part for writing (no copy)."""
    if isinstance(part, bytes):
        return part
    return part.reshape(-1).view(np.uint8)


# -- decoding ---------------------------------------------------------------------------------------


class Header(NamedTuple):
    """A parsed, validated header: the tree, each part's expected (dtype, shape) or None for bytes,
    and the inline blob (a view into the header value)."""

    tree: Any
    parts: list[tuple[np.dtype, tuple[int, ...]] | None]
    blob: Any


@functools.lru_cache(maxsize=512)
def _dtype(text: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
        _check_dtype(dtype)
    except TypeError as exc:
        raise CorruptRecordError(f"array node has an unacceptable dtype {text[:40]!r} ({exc})") from None
    return dtype


def parse_header(header: bytes | memoryview) -> Header:
    """Parse and validate a header value; ``CorruptRecordError`` when it is not a valid record."""
    if len(header) < _PREFIX.size:
        raise CorruptRecordError(f"header of {len(header)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, count, text_len = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise CorruptRecordError(f"header starts with {bytes(magic)!r}, expected {MAGIC!r}")
    end = _PREFIX.size + text_len
    if end > len(header):
        raise CorruptRecordError(f"header announces {text_len} bytes of JSON, it holds {len(header) - _PREFIX.size}")
    try:
        tree = json.loads(bytes(header[_PREFIX.size : end]).decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecordError(f"header JSON is unreadable ({type(exc).__name__}: {exc})") from None
    blob = memoryview(header)[_align(end, _INLINE_ALIGN) :]
    specs: dict[int, tuple[np.dtype, tuple[int, ...]] | None] = {}
    _walk(tree, specs, len(blob), 0)
    if sorted(specs) != list(range(len(specs))) or len(specs) != count:
        raise CorruptRecordError(f"header announces {count} parts, its tree uses parts {sorted(specs)[:8]}")
    return Header(tree, [specs[i] for i in range(count)], blob)


def _array_node(n: list) -> tuple[np.dtype, tuple[int, ...], int]:
    if len(n) != 5 or not isinstance(n[1], str) or not isinstance(n[2], list) or n[4] not in (0, 1):
        raise CorruptRecordError(f"malformed array node {str(n)[:80]!r}")
    shape = n[2]
    if len(shape) > 64 or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
        raise CorruptRecordError(f"array node has an invalid shape {str(shape)[:80]}")
    if n[4] == 1 and shape:
        raise CorruptRecordError("a numpy-scalar node has a non-empty shape")
    dtype = _dtype(n[1])
    return dtype, tuple(shape), math.prod(shape) * dtype.itemsize


def _claim(specs: dict, index: Any, spec: tuple[np.dtype, tuple[int, ...]] | None) -> None:
    if type(index) is not int or index in specs or not 0 <= index < 2**31:
        raise CorruptRecordError(f"part index {index!r} is invalid or used twice")
    specs[index] = spec


def _walk(n: Any, specs: dict, blob_len: int, depth: int) -> None:
    if depth > MAX_DEPTH or not isinstance(n, list) or not n or not isinstance(n[0], str):
        raise CorruptRecordError(f"malformed node {str(n)[:80]!r}")
    tag = n[0]
    if tag == "A":
        _, _, nbytes = _array_node(n)
        offset = n[3]
        if type(offset) is not int or offset < 0 or offset % _INLINE_ALIGN or offset + nbytes > blob_len:
            raise CorruptRecordError(f"inline array at {offset!r} of {nbytes} bytes lies outside the {blob_len}-byte blob")
    elif tag == "a":
        dtype, shape, _ = _array_node(n)
        _claim(specs, n[3], (dtype, shape))
    elif tag == "y":
        if len(n) != 2:
            raise CorruptRecordError(f"malformed bytes node {str(n)[:80]!r}")
        _claim(specs, n[1], None)
    elif tag == "d":
        if len(n) != 3 or not isinstance(n[1], list) or not isinstance(n[2], list) or len(n[1]) != len(n[2]):
            raise CorruptRecordError("malformed dict node")
        if not all(isinstance(k, str) for k in n[1]):
            raise CorruptRecordError("dict node has a non-string key")
        for child in n[2]:
            _walk(child, specs, blob_len, depth + 1)
    elif tag in ("l", "t"):
        if len(n) != 2 or not isinstance(n[1], list):
            raise CorruptRecordError(f"malformed {tag} node")
        for child in n[1]:
            _walk(child, specs, blob_len, depth + 1)
    elif tag == "n":
        if len(n) != 1:
            raise CorruptRecordError("malformed None node")
    elif tag in _SCALAR_TYPES:
        if len(n) != 2 or type(n[1]) is not _SCALAR_TYPES[tag]:
            raise CorruptRecordError(f"malformed {tag} node {str(n)[:80]!r}")
    else:
        raise CorruptRecordError(f"unknown node tag {tag[:20]!r}")


def materialize(header: Header, buffers: list[Any]) -> Any:
    """The payload, copied out of the header's blob and the part ``buffers`` (which may be views into
    the database, valid only during a read transaction). All arrays share one allocation; a kept
    array keeps its record's allocation alive (copy it to keep a small piece of a large record)."""
    if len(buffers) != len(header.parts):
        raise CorruptRecordError(f"{len(header.parts)} parts expected, {len(buffers)} found")
    offsets, total = [], _align(len(header.blob), _PART_ALIGN)
    for spec, buf in zip(header.parts, buffers):
        if spec is None:
            offsets.append(-1)
            continue
        want = math.prod(spec[1]) * spec[0].itemsize
        if len(buf) != want:
            raise CorruptRecordError(f"a {spec[0]} array of shape {spec[1]} needs {want} bytes, the part holds {len(buf)}")
        offsets.append(total)
        total += _align(want, _PART_ALIGN)
    arena = np.empty(total, dtype=np.uint8)
    if len(header.blob):
        arena[: len(header.blob)] = np.frombuffer(header.blob, dtype=np.uint8)
    parts: list[Any] = []
    for spec, buf, offset in zip(header.parts, buffers, offsets):
        if spec is None:
            parts.append(bytes(buf))
            continue
        piece = arena[offset : offset + len(buf)]
        if len(buf):
            piece[:] = np.frombuffer(buf, dtype=np.uint8)
        parts.append(_view(piece, spec[0], spec[1]))
    return _build(header.tree, parts, arena)


def _view(piece: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if not piece.nbytes or not dtype.itemsize:
        return np.empty(shape, dtype=dtype)
    return piece.view(dtype).reshape(shape)


def _build(n: list, parts: list[Any], arena: np.ndarray) -> Any:
    tag = n[0]
    if tag == "A":
        dtype = _dtype(n[1])
        arr = _view(arena[n[3] : n[3] + math.prod(n[2]) * dtype.itemsize], dtype, tuple(n[2]))
        return arr[()] if n[4] else arr
    if tag == "a":
        arr = parts[n[3]]
        return arr[()] if n[4] else arr
    if tag == "d":
        return {k: _build(v, parts, arena) for k, v in zip(n[1], n[2])}
    if tag == "l":
        return [_build(v, parts, arena) for v in n[1]]
    if tag == "t":
        return tuple(_build(v, parts, arena) for v in n[1])
    if tag == "n":
        return None
    if tag == "f":
        try:
            return float.fromhex(n[1])
        except ValueError:
            raise CorruptRecordError(f"float node {n[1][:40]!r} is not a hex float") from None
    if tag == "y":
        return parts[n[1]]
    return n[1]  # b, i, s: already the right Python type (checked by _walk)


def decode(header: bytes | memoryview, buffers: list[Any]) -> Any:
    """Decode a record from its header value and its raw part buffers."""
    return materialize(parse_header(header), buffers)
