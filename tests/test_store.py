"""The core's in-memory store against the FragmentStore conformance suite."""

from mineonline_core.contracts.store import MemoryStore
from mineonline_core.testing.store_conformance import FragmentStoreConformance


class TestMemoryStore(FragmentStoreConformance):
    store_cls = MemoryStore
