"""The lmdb store against the core's FragmentStore conformance suite."""

from mineonline_core.testing.store_conformance import FragmentStoreConformance
from mineonline_lmdb import LMDBStore


class TestLMDBStore(FragmentStoreConformance):
    store_cls = LMDBStore
