"""A pickle-free record format for payload trees.

A record is one **header** plus N raw **parts**. The header is ``b"MOL1"``, the part count (uint32,
little-endian) and a JSON description of the tree; each numpy array (or ``bytes`` leaf) becomes one
part holding its raw C-ordered buffer. The JSON nodes are tagged lists:

=================================  ===========================================================
``["d", [keys...], [nodes...]]``   dict with string keys, insertion order kept
``["l", [nodes...]]``              list
``["t", [nodes...]]``              tuple
``["n"]``                          None
``["b", true]``                    Python bool
``["i", 12]``                      Python int (any size)
``["f", "0x1.8p+1"]``              Python float, as ``float.hex`` so every bit survives
``["s", "text"]``                  Python str
``["y", part]``                    Python bytes
``["a", dtype, shape, part, 0|1]`` numpy array (1: a numpy scalar such as ``np.float32(1)``)
=================================  ===========================================================

Decoding validates every field against the parts it is given, so a tampered record raises
``CorruptRecordError``; nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from mineonline_core.errors import MineOnlineError

MAGIC = b"MOL1"
_PREFIX = struct.Struct("<4sI")
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


def encode(payload: Any) -> tuple[bytes, list[np.ndarray | bytes]]:
    """``payload`` as (header, parts); parts alias the payload's own buffers where possible."""
    parts: list[np.ndarray | bytes] = []
    tree = _encode_node(payload, parts, 0)
    header = _PREFIX.pack(MAGIC, len(parts)) + json.dumps(tree, separators=(",", ":")).encode("ascii")
    return header, parts


# The recursive helpers are module functions, not closures: a recursive closure is a reference cycle
# that would keep every array of a record alive until the garbage collector runs, and fresh memory
# for each record costs more (page faults) than copying it.
def _encode_node(x: Any, parts: list, depth: int) -> list:
    if depth > MAX_DEPTH:
        raise ValueError(f"a replay payload is nested deeper than {MAX_DEPTH} levels")
    if isinstance(x, (np.ndarray, np.generic)):
        arr = np.asarray(x)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # the only copy on the write path, for strided views
        _check_dtype(arr.dtype)
        parts.append(arr)
        return ["a", arr.dtype.str, list(arr.shape), len(parts) - 1, int(isinstance(x, np.generic))]
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, str):
                raise TypeError(f"a replay payload has a dict key {k!r} of type {type(k).__name__}; keys must be str")
        return ["d", list(x), [_encode_node(v, parts, depth + 1) for v in x.values()]]
    if isinstance(x, tuple):
        return ["t", [_encode_node(v, parts, depth + 1) for v in x]]
    if isinstance(x, list):
        return ["l", [_encode_node(v, parts, depth + 1) for v in x]]
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


def part_count(header: bytes | memoryview) -> int:
    """The number of parts a header announces (0 when the header is unreadable)."""
    if len(header) < _PREFIX.size:
        return 0
    magic, count = _PREFIX.unpack_from(header)
    return count if magic == MAGIC else 0


def decode_header(header: bytes | memoryview) -> tuple[int, Any]:
    """(part count, JSON tree) of a header; ``CorruptRecordError`` when it is not one of ours."""
    if len(header) < _PREFIX.size:
        raise CorruptRecordError(f"header of {len(header)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, count = _PREFIX.unpack_from(header)
    if magic != MAGIC:
        raise CorruptRecordError(f"header starts with {bytes(magic)!r}, expected {MAGIC!r}")
    try:
        tree = json.loads(bytes(header[_PREFIX.size :]).decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptRecordError(f"header JSON is unreadable ({type(exc).__name__}: {exc})") from None
    return count, tree


def array_spec(tree: Any) -> list[tuple[np.dtype, tuple[int, ...]] | None]:
    """Per part, the (dtype, shape) its array must have (None for a bytes part); validates the tree."""
    specs: dict[int, tuple[np.dtype, tuple[int, ...]] | None] = {}
    _walk(tree, specs, 0)
    if sorted(specs) != list(range(len(specs))):
        raise CorruptRecordError("part indices are not 0..N-1")
    return [specs[i] for i in range(len(specs))]


def _claim(specs: dict, index: Any, spec: tuple[np.dtype, tuple[int, ...]] | None) -> None:
    if type(index) is not int or index in specs or not 0 <= index < 2**31:
        raise CorruptRecordError(f"part index {index!r} is invalid or used twice")
    specs[index] = spec


def _walk(n: Any, specs: dict, depth: int) -> None:
    if depth > MAX_DEPTH or not isinstance(n, list) or not n or not isinstance(n[0], str):
        raise CorruptRecordError(f"malformed node {str(n)[:80]!r}")
    tag = n[0]
    if tag == "a":
        if len(n) != 5 or not isinstance(n[1], str) or not isinstance(n[2], list) or n[4] not in (0, 1):
            raise CorruptRecordError(f"malformed array node {str(n)[:80]!r}")
        try:
            dtype = np.dtype(n[1])
            _check_dtype(dtype)
        except TypeError as exc:
            raise CorruptRecordError(f"array node has an unacceptable dtype {n[1][:40]!r} ({exc})") from None
        shape = n[2]
        if len(shape) > 64 or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape):
            raise CorruptRecordError(f"array node has an invalid shape {str(shape)[:80]}")
        if n[4] == 1 and shape:
            raise CorruptRecordError("a numpy-scalar node has a non-empty shape")
        _claim(specs, n[3], (dtype, tuple(shape)))
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
            _walk(child, specs, depth + 1)
    elif tag in ("l", "t"):
        if len(n) != 2 or not isinstance(n[1], list):
            raise CorruptRecordError(f"malformed {tag} node")
        for child in n[1]:
            _walk(child, specs, depth + 1)
    elif tag == "n":
        if len(n) != 1:
            raise CorruptRecordError("malformed None node")
    elif tag in _SCALAR_TYPES:
        if len(n) != 2 or type(n[1]) is not _SCALAR_TYPES[tag]:
            raise CorruptRecordError(f"malformed {tag} node {str(n)[:80]!r}")
    else:
        raise CorruptRecordError(f"unknown node tag {tag[:20]!r}")


def expected_nbytes(spec: tuple[np.dtype, tuple[int, ...]]) -> int:
    dtype, shape = spec
    return math.prod(shape) * dtype.itemsize


def build(tree: Any, parts: list[Any]) -> Any:
    """The payload from a validated tree and its decoded parts (arrays or bytes)."""
    tag = tree[0]
    if tag == "a":
        arr = parts[tree[3]]
        return arr[()] if tree[4] else arr
    if tag == "d":
        return {k: build(v, parts) for k, v in zip(tree[1], tree[2])}
    if tag == "l":
        return [build(v, parts) for v in tree[1]]
    if tag == "t":
        return tuple(build(v, parts) for v in tree[1])
    if tag == "n":
        return None
    if tag == "f":
        try:
            return float.fromhex(tree[1])
        except ValueError:
            raise CorruptRecordError(f"float node {tree[1][:40]!r} is not a hex float") from None
    if tag == "y":
        return parts[tree[1]]
    return tree[1]  # b, i, s: already the right Python type (checked in array_spec)


def decode(header: bytes | memoryview, buffers: list[Any]) -> Any:
    """Decode a record from its header and raw part buffers (copied out, see ``copy_parts``)."""
    count, tree = decode_header(header)
    specs = array_spec(tree)
    if count != len(specs) or len(buffers) != count:
        raise CorruptRecordError(f"header announces {count} parts, tree uses {len(specs)}, {len(buffers)} found")
    return build(tree, copy_parts(specs, buffers))


_ALIGN = 64


def copy_parts(specs: list[tuple[np.dtype, tuple[int, ...]] | None], buffers: list[Any]) -> list[Any]:
    """Writable arrays (or bytes) copied from raw buffers that may be views into the database.

    All arrays of a record share one allocation, each at a 64-byte-aligned offset: one allocation
    and one copy per array, as cheap as reading the record as a single value. (A kept array keeps
    its record's allocation alive; copy it to keep a small piece of a large record.)
    """
    offsets, total = [], 0
    for spec, buf in zip(specs, buffers):
        if spec is None:
            offsets.append(-1)
            continue
        want = expected_nbytes(spec)
        if len(buf) != want:
            raise CorruptRecordError(
                f"a {spec[0]} array of shape {spec[1]} needs {want} bytes, the part holds {len(buf)}"
            )
        offsets.append(total)
        total += -(-want // _ALIGN) * _ALIGN
    arena = np.empty(total, dtype=np.uint8)
    out: list[Any] = []
    for spec, buf, offset in zip(specs, buffers, offsets):
        if spec is None:
            out.append(bytes(buf))
            continue
        dtype, shape = spec
        n = len(buf)
        if n == 0 or dtype.itemsize == 0:
            out.append(np.empty(shape, dtype=dtype))
            continue
        piece = arena[offset : offset + n]
        piece[:] = np.frombuffer(buf, dtype=np.uint8)
        out.append(piece.view(dtype).reshape(shape))
    return out


def raw_view(part: np.ndarray | bytes) -> Any:
    """A flat byte view of a part for writing (no copy)."""
    if isinstance(part, bytes):
        return part
    if part.nbytes == 0:
        return b""
    return part.reshape(-1).view(np.uint8)
