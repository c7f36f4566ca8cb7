"""Hypothesis strategies for arbitrary valid protocol messages."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    KVEvent,
    LoadSpec,
    SaveSpec,
    Stats,
)

ids = st.text(min_size=1, max_size=12)
block = st.integers(min_value=0, max_value=2**40)
group = st.lists(block, max_size=6).map(tuple)

plain: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
plain_maps = st.dictionaries(st.text(max_size=8), plain, max_size=4)


@st.composite
def load_specs(draw: st.DrawFn) -> LoadSpec:
    remote = draw(st.lists(group, min_size=1, max_size=3))
    local = [g[len(g) - draw(st.integers(0, len(g))) :] for g in remote]
    return LoadSpec(
        request_id=draw(ids),
        local_block_ids=local,
        remote_engine_id=draw(ids),
        remote_block_ids=remote,
        remote_request_id=draw(ids),
    )


save_specs = st.builds(SaveSpec, request_id=ids, block_ids=st.lists(group, max_size=3).map(tuple))
finite = st.floats(allow_nan=False, allow_infinity=False)
stats = st.builds(
    Stats,
    counters=st.dictionaries(
        ids, st.integers(0, 2**63) | st.floats(0, 1e12, allow_nan=False), max_size=4
    ),
    gauges=st.dictionaries(ids, st.integers(-(2**40), 2**40) | finite, max_size=4),
)
events = st.builds(KVEvent, kind=ids, data=plain_maps)

metadata = st.builds(
    ConnectorMetadata,
    step=st.integers(0, 2**63),
    loads=st.lists(load_specs(), max_size=3),
    saves=st.lists(save_specs, max_size=3),
    free_request_ids=st.frozensets(ids, max_size=4),
    abort_request_ids=st.frozensets(ids, max_size=4),
    extra=plain_maps,
)
outputs = st.builds(
    ConnectorOutput,
    finished_sending=st.frozensets(ids, max_size=4),
    finished_recving=st.frozensets(ids, max_size=4),
    invalid_block_ids=st.frozensets(block, max_size=6),
    failures=st.dictionaries(ids, st.text(max_size=20), max_size=3),
    stats=stats,
    events=st.lists(events, max_size=3),
)
