"""Conformance suites for plugin authors: subclass one to test your component against the contract.

Example, for a fragment store::

    from mineonline_core.testing.store_conformance import FragmentStoreConformance

    class TestMyStore(FragmentStoreConformance):
        store_cls = MyStore

Suites live in their own modules and import pytest, so this package stays import-light.
"""
