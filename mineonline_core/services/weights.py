"""Model weights between the trainer and rollout: one wire format and one receiver.

* **On the wire** (``PackedWeights``): a state dict as one host array per dtype, each the dtype's raw
  bytes (``uint8``) with the dtype's name beside it, and where each key lies in them. bfloat16, which
  numpy lacks, and float16 travel bit-exactly; the arrays are numpy because Ray hands numpy to a
  reader on the same node as read-only views of the object store (pickle protocol 5), with no copy.
  It is a read-only mapping of key to tensor, so whatever takes a state dict takes it.
* **Into a live model** (``WeightReceiver``): the one loader of the in-process rollout policy
  (``rollout/localpolicy.py``) and the shared inference server (``rollout/inference.py``). It checks
  keys, shapes and dtypes in one pass that touches no data and names every difference, then copies each
  tensor once. On CUDA the copies come from pinned host buffers (allocated once per layout, reused by
  every version), are issued ``non_blocking`` on the receiver's own stream, and end with one event that
  the loading thread alone waits for: no copy synchronises per parameter, and the stream that runs the
  forwards never waits for a load.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mineonline_core.errors import RunFailedError

#: key -> (index of its flat buffer, offset in elements of that buffer's dtype, shape)
Places = dict[str, tuple[int, int, tuple[int, ...]]]


class WeightsMismatchError(RunFailedError):
    """Published weights do not fit the model they are loaded into."""


def layout(state: Mapping[str, Any]) -> tuple[list[tuple[torch.device, torch.dtype, int]], Places]:
    """Group ``state``'s tensors by (device, dtype), in key order: ``[(device, dtype, numel)]`` per
    flat buffer, and each key's place in them."""
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    places: Places = {}
    for key, value in state.items():
        group = (value.device, value.dtype)
        offset = sizes.setdefault(group, 0)
        places[key] = (list(sizes).index(group), offset, tuple(value.shape))
        sizes[group] = offset + value.numel()
    return [(device, dtype, n) for (device, dtype), n in sizes.items()], places


def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """A flat host buffer, page-locked when ``pinned`` (only then can a copy to or from a GPU be
    asynchronous; pinning needs CUDA, so a CPU-only process never asks for it)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)


def views(flats: Sequence[torch.Tensor], places: Places) -> dict[str, torch.Tensor]:
    """Each key's tensor: a view of its flat buffer."""
    return {k: flats[i][o : o + _numel(shape)].view(shape) for k, (i, o, shape) in places.items()}


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightsMismatchError(f"the published weights name an unknown dtype {name!r}")
    return dtype


class PackedWeights(Mapping[str, torch.Tensor]):
    """A state dict on the wire (see the module doc). The tensors it maps to share its arrays' memory."""

    def __init__(self, *, flats: Sequence[np.ndarray], dtypes: Sequence[str], places: Places) -> None:
        self.flats, self.dtypes, self.places = list(flats), list(dtypes), dict(places)
        self._typed: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, flats: Sequence[torch.Tensor], places: Places) -> PackedWeights:
        """Wrap host ``flats`` (1-D, contiguous) without copying: they must not change until sent."""
        return cls(
            flats=[flat.view(torch.uint8).numpy() for flat in flats],
            dtypes=[str(flat.dtype).removeprefix("torch.") for flat in flats],
            places=places,
        )

    def typed_flats(self) -> list[torch.Tensor]:
        """The flat buffers as tensors of their own dtypes (views of the arrays)."""
        if self._typed is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # read-only arrays of the object store: only read
                self._typed = [torch.from_numpy(a).view(_dtype(d)) for a, d in zip(self.flats, self.dtypes)]
        return self._typed

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_typed": None}  # the arrays alone travel, out of band

    def __getitem__(self, key: str) -> torch.Tensor:
        i, offset, shape = self.places[key]
        return self.typed_flats()[i][offset : offset + _numel(shape)].view(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.places)

    def __len__(self) -> int:
        return len(self.places)


def pack_state(state: Mapping[str, torch.Tensor]) -> PackedWeights:
    """A state dict copied to new host buffers and packed (for a one-off put; the trainer's broadcast
    packs its reused snapshot instead, ``trainer/snapshot.py``)."""
    groups, places = layout(state)
    flats = [torch.empty(n, dtype=dtype) for _, dtype, n in groups]
    with torch.no_grad():
        for key, view in views(flats, places).items():
            view.copy_(state[key].detach())
    return PackedWeights.of(flats, places)


def _as_tensors(weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if isinstance(weights, PackedWeights):
        return dict(weights.items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store: only read
        return {k: torch.as_tensor(v) for k, v in weights.items()}


def check_fits(targets: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Raise ``WeightsMismatchError`` naming every missing or unexpected key and every shape or dtype
    that differs (metadata only: no tensor data is read)."""
    missing = [k for k in targets if k not in sources]
    unexpected = [k for k in sources if k not in targets]
    differ = [
        f"{k!r}: sent {tuple(s.shape)} {s.dtype}, model {tuple(t.shape)} {t.dtype}"
        for k, t in targets.items()
        if (s := sources.get(k)) is not None and (s.shape != t.shape or s.dtype != t.dtype)
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(map(str, items[:5]))}{' ...' if len(items) > 5 else ''}"
        for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("differing", differ))
        if items
    ]
    if problems:
        raise WeightsMismatchError(
            f"the published weights do not fit {what}: {'; '.join(problems)}. The trainer and rollout build "
            f"the policy with the same policy_generator: the two models differ (a generator that depends on "
            f"its process, or weights published by another run)."
        )


class WeightReceiver:
    """Loads published weights into live modules (see the module doc). One loading thread at a time:
    its staging buffers are reused by every load."""

    def __init__(self, *, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.version: int | None = None  # the version of the last weights loaded with one
        self._staging: tuple[Places, list[torch.Tensor]] | None = None  # pinned host buffers (CUDA)
        self._stream: Any = None  # the loads' CUDA stream, made at the first load

    def load(
        self,
        module: torch.nn.Module,
        weights: Mapping[str, Any],
        *,
        version: int | None = None,
        what: str = "the policy",
    ) -> None:
        """Copy ``weights`` (a state dict of tensors or arrays, or ``PackedWeights``) into ``module``'s
        parameters and buffers, in place; returns once they are in. ``version`` is recorded."""
        targets = module.state_dict()
        sources = _as_tensors(weights)
        check_fits(targets, sources, what=what)
        with torch.no_grad():
            if self.device.type == "cuda":
                self._load_cuda(targets, sources, weights)
            else:
                for key, target in targets.items():
                    target.copy_(sources[key])
        if version is not None:
            self.version = int(version)

    def _load_cuda(
        self, targets: Mapping[str, torch.Tensor], sources: Mapping[str, torch.Tensor], weights: Mapping[str, Any]
    ) -> None:
        staged = self._stage(sources, weights)
        if self._stream is None:
            if self.device.index is None:  # a bare "cuda": the stream and the waits name one GPU
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.Stream(device=self.device)
        # The module may be one whose last forward is still queued on the forwards' stream: write it
        # only after that (a wait on the GPU, not here).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        # blocking: the wait below sleeps; a default event spins this thread's core for the whole copy.
        done = torch.cuda.Event(blocking=True)
        with torch.cuda.stream(self._stream):
            for key, target in targets.items():
                target.copy_(staged[key], non_blocking=True)
            done.record(self._stream)
        # The one wait of a load, on this (loading) thread: after it the weights are in, so the next
        # forward on any stream sees them, and the pinned buffers may take the next version.
        done.synchronize()

    def _stage(self, sources: Mapping[str, torch.Tensor], weights: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``sources`` copied into pinned host buffers (host to host, no device involved)."""
        host = {k: v for k, v in sources.items() if v.device.type == "cpu"}
        groups, places = layout(host)
        if self._staging is None or self._staging[0] != places:
            self._staging = None  # the old buffers go before the new ones come
            self._staging = (places, [host_buffer(n, dtype, pinned=True) for _, dtype, n in groups])
        flats = self._staging[1]
        staged = views(flats, places)
        if isinstance(weights, PackedWeights) and weights.places == places:
            for flat, source in zip(flats, weights.typed_flats()):  # one copy per buffer
                flat.copy_(source)
        else:
            for key, view in staged.items():
                view.copy_(host[key])
        return {**sources, **staged}  # a source already on a device is copied from where it is
