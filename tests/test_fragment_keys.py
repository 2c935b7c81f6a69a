"""A fragment's store key and its stream's name are built and parsed in one place
(``contracts/fragment.py``): the rollout worker names streams, the replay buffer rebuilds its index
from keys on resume and the rollout manager finds the first free incarnation from them."""

from __future__ import annotations

from mineonline_core.contracts import fragment as F


def test_keys_and_stream_names_round_trip():
    stream = F.stream_name(3, 12, 7)
    assert stream == "3.12.7" and F.parse_stream(stream) == (3, 12, 7)
    key = F.fragment_key(stream, 41)
    assert key == "3.12.7.000000041" and F.parse_fragment_key(key) == (stream, 41)
    # Keys stay sortable within a stream.
    assert sorted(F.fragment_key(stream, i) for i in (10, 9, 100)) == [F.fragment_key(stream, i) for i in (9, 10, 100)]


def test_what_no_worker_wrote_does_not_parse():
    assert F.parse_fragment_key("unrelated") is None and F.parse_fragment_key("s.x") is None
    assert F.parse_fragment_key(".000000001") is None
    assert F.parse_fragment_key("s.000000002") == ("s", 2)  # a free-form stream (tests) is still a key
    assert F.parse_stream("s") is None and F.parse_stream("1.x.0") is None and F.parse_stream("1.2.3.4") is None
