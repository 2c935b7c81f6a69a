"""``torch.cuda``'s streams, events and pinned host buffers faked on the CPU, for tests of code written for
a GPU on a machine without one: the code runs its CUDA path with CPU tensors, and the fake records what it
asked of CUDA, in order: which stream each copy ran on, what waited for what, and on which thread.

Install it with pytest's ``monkeypatch`` (``FakeCuda().install(monkeypatch)``); the patches go with the test.
It fakes what the weight hand-over uses (``services/weights.py``, ``trainer/snapshot.py``): ``Stream``
(``wait_stream``, ``wait_event``), ``Event`` (``record``, ``synchronize``), ``stream``, ``current_stream``,
``current_device``, ``synchronize``, ``Tensor.copy_`` (recorded, then run) and ``weights.host_buffer``. It has no
device memory, so it cannot show a tensor used on a stream it was not allocated on (which needs ``record_stream``)
nor a copy between devices: tests of those need a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

from mineonline_core.services import weights as W


class _Stream:
    def __init__(self, fake: FakeCuda, name: str) -> None:
        self.fake, self.name = fake, name

    def wait_stream(self, other: _Stream) -> None:
        self.fake.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.fake.log.append(("wait_event", self.name, event.id))


class _Event:
    def __init__(self, fake: FakeCuda, *, blocking: bool = False) -> None:
        self.fake, self.id, self.blocking = fake, next(fake._ids), blocking
        fake.events.append(self)

    def record(self, stream: _Stream | None = None) -> None:
        self.fake.log.append(("record", self.id, stream.name if stream is not None else self.fake.current()))

    def synchronize(self) -> None:
        self.fake.log.append(("event_sync", self.id, threading.current_thread().name))


class FakeCuda:
    """``log`` holds, in order: ``("record", event, stream)``, ``("wait_event", stream, event)``,
    ``("wait_stream", stream, other)``, ``("event_sync", event, thread name)``, ``("device_sync",)`` and
    ``("copy", non_blocking, stream)`` for every ``Tensor.copy_``. ``pinned`` holds ``(numel, dtype,
    pinned)`` for every host buffer asked for; ``async_unpinned`` counts the ``non_blocking`` copies neither
    side of which is such a pinned buffer (on a GPU: a host-to-device copy that is not asynchronous, or one
    from memory its owner may reuse before the copy ran; in these tests every tensor is a host one, so the
    device-to-device copies of real CUDA do not occur). ``events`` holds every event made, with its
    ``blocking`` flag. Streams are named ``default`` and ``side0``, ``side1``..."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.pinned: list[tuple[int, torch.dtype, bool]] = []
        self.async_unpinned = 0
        self.events: list[_Event] = []
        self._pinned_storages: list[torch.Tensor] = []  # kept alive, so that their addresses stay theirs
        self._ids = itertools.count()
        self._streams = itertools.count()
        self._local = threading.local()  # the current stream, per thread as CUDA's
        self.default = _Stream(self, "default")

    def current(self) -> str:
        return getattr(self._local, "stream", self.default).name

    def take(self) -> list[tuple]:
        """The log so far, emptied."""
        out, self.log = self.log, []
        return out

    @contextlib.contextmanager
    def _stream_context(self, stream: _Stream) -> Iterator[None]:
        previous = getattr(self._local, "stream", self.default)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def _is_pinned(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return ptr != 0 and any(ptr == b.untyped_storage().data_ptr() for b in self._pinned_storages)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_copy = torch.Tensor.copy_

        def copy_(tensor: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
            self.log.append(("copy", non_blocking, self.current()))
            if non_blocking and not (self._is_pinned(tensor) or self._is_pinned(src)):
                self.async_unpinned += 1
            return real_copy(tensor, src, non_blocking)

        def host_buffer(numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
            self.pinned.append((numel, dtype, pinned))
            buffer = torch.empty(numel, dtype=dtype)  # pinning needs CUDA
            if pinned:
                self._pinned_storages.append(buffer)
            return buffer

        monkeypatch.setattr(
            torch.cuda, "Stream", lambda device=None, priority=0: _Stream(self, f"side{next(self._streams)}")
        )
        monkeypatch.setattr(
            torch.cuda,
            "Event",
            lambda enable_timing=False, blocking=False, interprocess=False: _Event(self, blocking=blocking),
        )
        monkeypatch.setattr(torch.cuda, "stream", self._stream_context)
        monkeypatch.setattr(
            torch.cuda, "current_stream", lambda device=None: getattr(self._local, "stream", self.default)
        )
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.log.append(("device_sync",)))
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(W, "host_buffer", host_buffer)
