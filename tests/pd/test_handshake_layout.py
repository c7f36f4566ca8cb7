"""The KV layout in the handshake (version 5): each side's layout travels as fields
(:class:`KVLayoutFacts`), a mismatch is refused naming every differing field with both sides'
values and what would work, hostile layout fields are refused as malformed, and nothing is
ever prepared for reading from a peer whose layout differs.

The workers are real PDConnector workers over the in-process transport; the handshake runs
over pyzmq on loopback, as between engines.
"""

from __future__ import annotations

import re
import time
from typing import Any

import attrs
import pytest
import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.connectors.pd.handshake import (
    HANDSHAKE_VERSION,
    HandshakeRefusal,
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    KVLayerFacts,
    KVLayoutFacts,
    check_kv_layout,
    compat_hash,
    decode_frame,
    encode_frame,
    handshake,
    layout_mismatches,
)
from kvframe.connectors.pd.peers import PeerState
from kvframe.errors import HandshakeError, IncompatiblePeerError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo
from kvframe.spi.transport import BlockLayout, MemoryRegion

CHASH = compat_hash(model="m")


def _facts(**kw: Any) -> KVLayoutFacts:
    base: dict[str, Any] = {
        "order": "NHD",
        "block_size": 16,
        "head_size": 8,
        "num_kv_heads": 4,
        "kv_heads_per_rank": 4,
        "tp_size": 1,
        "layers": (
            KVLayerFacts(name="l0", shape=(2, 16, 4, 8), dtype="torch.float16"),
            KVLayerFacts(name="l1", shape=(2, 16, 4, 8), dtype="torch.float16"),
        ),
    }
    return KVLayoutFacts(**{**base, **kw})


def _layers(shape: tuple[int, ...], dtype: str = "torch.float16", n: int = 2) -> Any:
    return tuple(KVLayerFacts(name=f"l{i}", shape=shape, dtype=dtype) for i in range(n))


def _raw(shape: tuple[int, ...] = (2, 16, 4, 8), dtype: str = "torch.float16", n: int = 2) -> Any:
    # Layers as a hostile peer may send them: built without the validators.
    with attrs.validators.disabled():
        return tuple(KVLayerFacts(name=f"l{i}", shape=shape, dtype=dtype) for i in range(n))


def _raw_name(name: str) -> Any:
    with attrs.validators.disabled():
        return (KVLayerFacts(name=name, shape=(1,), dtype="f"),)


# -- the comparison -------------------------------------------------------------------------


def test_equal_layouts_match() -> None:
    assert layout_mismatches(_facts(), _facts()) == []
    check_kv_layout(_facts(), _facts(), "the peer")
    check_kv_layout(None, None, "the peer")  # a side without facts checks nothing


def test_block_sizes_one_a_multiple_of_the_other_match_in_nhd_and_hnd() -> None:
    # D regroups P's blocks as it reads (kvframe.core.blocksize): both directions.
    for size in (32, 64, 8, 4):
        assert (
            layout_mismatches(_facts(), _facts(block_size=size, layers=_layers((2, size, 4, 8))))
            == []
        )
    hnd = _facts(order="HND", layers=_layers((2, 4, 16, 8)))
    assert (
        layout_mismatches(hnd, _facts(order="HND", block_size=32, layers=_layers((2, 4, 32, 8))))
        == []
    )
    # Another difference behind the block size is still named.
    wrong = layout_mismatches(_facts(), _facts(block_size=32, layers=_layers((2, 32, 4, 8), n=3)))
    assert [w.split(":")[0] for w in wrong] == ["layers"]


def test_block_sizes_that_cannot_be_regrouped_are_refused_naming_both() -> None:
    opaque = _facts(order="block-major", head_size=0, num_kv_heads=0, kv_heads_per_rank=0)
    big = attrs.evolve(opaque, block_size=32, layers=_layers((2, 32, 4, 8)))
    with pytest.raises(
        IncompatiblePeerError,
        match=r"block size: this engine 16 tokens, the peer 32 tokens; a block-major cache "
        r"cannot be cut into token ranges: run both engines at one block size \(16 or 32\), or "
        r"describe both caches as NHD \(give both connectors EngineInfo.num_kv_heads\)",
    ):
        check_kv_layout(opaque, big, "the peer")
    # Facts whose layers do not hold the block size they name (a hostile or broken peer).
    liar = _facts(block_size=32)  # layers of 16 tokens
    with pytest.raises(
        IncompatiblePeerError,
        match=r"layer 'l0': the peer's shape \[2, 16, 4, 8\] does not hold blocks of 32 tokens",
    ):
        check_kv_layout(_facts(), liar, "the peer")


def test_heterogeneous_tp_shares_differ_per_rank_but_match() -> None:
    # P at TP 1 holds 4 heads a rank, D at TP 2 two: the model's shape is what is compared.
    d = _facts(tp_size=2, kv_heads_per_rank=2)
    assert layout_mismatches(_facts(), d) == []


@pytest.mark.parametrize(
    ("theirs", "expected"),
    [
        (
            _facts(order="HND"),
            r"cache order: this engine NHD \[blocks, 2, block_size, heads, head_size\], the peer "
            r"HND \[blocks, 2, heads, block_size, head_size\]; configure both engines' KV cache "
            r"layout alike",
        ),
        (
            _facts(block_size=24, layers=_layers((2, 24, 4, 8))),
            r"block size: this engine 16 tokens, the peer 24 tokens; KV moves between different "
            r"block sizes only when one is a whole multiple of the other: run both engines at one "
            r"block size \(16 or 24\), or at sizes such as 16 and 48",
        ),
        (
            _facts(layers=_layers((2, 16, 4, 8), "torch.bfloat16")),
            r"dtype: this engine torch.float16, the peer torch.bfloat16; run both engines with "
            r"one KV cache dtype",
        ),
        (
            _facts(head_size=16, layers=_layers((2, 16, 4, 16))),
            r"head size: this engine 8, the peer 16; serve the same model",
        ),
        (
            _facts(num_kv_heads=8, kv_heads_per_rank=8, layers=_layers((2, 16, 8, 8))),
            r"KV heads: this engine 4, the peer 8; serve the same model",
        ),
        (
            _facts(kv_heads_per_rank=2),
            r"KV heads per rank: this engine 4, the peer 2; shard the heads alike",
        ),
        (
            _facts(layers=_layers((2, 16, 4, 8), n=3)),
            r"layers: this engine 2 \('l0', 'l1'\), the peer 3 \('l0', 'l1', 'l2'\); serve the "
            r"same model",
        ),
        (
            _facts(order="block-major", head_size=0, num_kv_heads=0, kv_heads_per_rank=0),
            r"cache order: this engine NHD .* the peer block-major .*; and KV heads: this engine "
            r"4, the peer unknown; .*neither",
        ),
    ],
    ids=["order", "block_size", "dtype", "head_size", "heads", "heads_per_rank", "layers", "nhd"],
)
def test_each_differing_field_is_named_with_both_values(
    theirs: KVLayoutFacts, expected: str
) -> None:
    with pytest.raises(IncompatiblePeerError, match="KV layout mismatch with the peer") as err:
        check_kv_layout(_facts(), theirs, "the peer")
    assert err.match(expected)


def test_a_block_major_layer_shape_is_compared_when_nothing_else_differs() -> None:
    mine = _facts(order="block-major", head_size=0, num_kv_heads=0, kv_heads_per_rank=0)
    theirs = attrs.evolve(mine, layers=_layers((2, 16, 4, 9)))
    wrong = layout_mismatches(mine, theirs)
    assert wrong == [
        "layer 'l0': this engine [2, 16, 4, 8] torch.float16, the peer [2, 16, 4, 9] "
        "torch.float16; serve the same model with the same KV cache shape on both engines"
    ]


def test_a_missing_layout_is_refused() -> None:
    with pytest.raises(IncompatiblePeerError, match="the decoder sent no KV layout"):
        check_kv_layout(_facts(), None, "the decoder")


# -- hostile layout fields -------------------------------------------------------------------


_HOSTILE: list[tuple[str, dict[str, Any]]] = [
    ("order", {"order": "NDH"}),
    ("order", {"order": 3}),
    ("block_size", {"block_size": 0}),
    ("block_size", {"block_size": -16}),
    ("block_size", {"block_size": 1 << 40}),
    ("head_size", {"head_size": True}),
    ("num_kv_heads", {"num_kv_heads": -1}),
    ("kv_heads_per_rank", {"kv_heads_per_rank": 1.5}),
    ("tp_size", {"tp_size": 0}),
    ("layers", {"layers": ()}),
    ("layers", {"layers": _raw(n=4097)}),
    ("shape", {"layers": _raw((2, 0, 4, 8))}),
    ("shape", {"layers": _raw((2, 16, 4, 8, 1, 1, 1, 1, 1))}),
    ("shape", {"layers": _raw((2, 1 << 41))}),
    ("dtype", {"layers": _raw(dtype="torch.float16'; drop")}),
    ("dtype", {"layers": _raw(dtype="x" * 33)}),
    ("dtype", {"layers": _raw(dtype="")}),
    ("name", {"layers": _raw_name("")}),
    ("name", {"layers": _raw_name("n" * 256)}),
]


def _hostile_request(fields: dict[str, Any]) -> HandshakeRequest:
    with attrs.validators.disabled():
        bad = attrs.evolve(_facts(), **fields)
    return HandshakeRequest(
        engine_id="D", rank=0, transport="inprocess", transport_metadata=b"m", kv_layout=bad
    )


@pytest.mark.parametrize(("field", "fields"), _HOSTILE, ids=[f for f, _ in _HOSTILE])
def test_hostile_layout_fields_are_malformed_and_nothing_else_escapes(
    field: str, fields: dict[str, Any]
) -> None:
    frame = encode_frame(_hostile_request(fields), CHASH)
    with pytest.raises(HandshakeError, match="undecodable handshake payload") as err:
        decode_frame(frame, CHASH)
    assert not isinstance(err.value, IncompatiblePeerError)
    assert field in str(err.value)


def test_p_refuses_hostile_layouts_as_malformed_and_keeps_serving() -> None:
    import zmq

    srv = _server(_facts())
    ctx = zmq.Context.instance()
    try:
        for _, fields in _HOSTILE:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{srv.port}")
            sock.send(encode_frame(_hostile_request(fields), CHASH))
            assert sock.poll(3000, zmq.POLLIN)
            answer = decode_frame(sock.recv(), CHASH)
            sock.close(linger=0)
            assert isinstance(answer, HandshakeRefusal)
            assert answer.code == "malformed"
        req = HandshakeRequest(
            engine_id="D",
            rank=0,
            transport="inprocess",
            transport_metadata=b"m",
            kv_layout=_facts(),
        )
        assert handshake("127.0.0.1", srv.port, req, chash=CHASH).response.kv_layout == _facts()
        assert srv.rejected == len(_HOSTILE)
        assert srv.served == 1
    finally:
        srv.close()


# -- over the side channel -------------------------------------------------------------------

LAYOUT = BlockLayout(
    regions=(MemoryRegion(addr=4096, length=1 << 16),), block_lens=(4096,), num_blocks=16
)


def _server(
    kv_layout: KVLayoutFacts | None, answer: KVLayoutFacts | None = None
) -> HandshakeServer:
    def respond(req: HandshakeRequest, session: bytes | None) -> HandshakeResponse:
        return HandshakeResponse(
            engine_id="P",
            rank=0,
            tp_size=1,
            transport="inprocess",
            transport_metadata=b"p",
            layout=LAYOUT,
            kv_lease_duration=30.0,
            kv_layout=answer,
        )

    return HandshakeServer("127.0.0.1", 0, chash=CHASH, respond=respond, kv_layout=kv_layout)


def test_d_checks_the_answer_itself() -> None:
    # A P that does not check (no kv_layout) and answers with another layout, or none: D
    # refuses the answer before it returns anything to read with.
    req = HandshakeRequest(
        engine_id="D", rank=0, transport="inprocess", transport_metadata=b"m", kv_layout=_facts()
    )
    for answer, fragment in [
        (_facts(block_size=24), "block size: this engine 16 tokens, the peer 24 tokens"),
        (None, "the prefill engine sent no KV layout"),
    ]:
        srv = _server(None, answer)
        try:
            with pytest.raises(IncompatiblePeerError, match=fragment):
                handshake("127.0.0.1", srv.port, req, chash=CHASH, timeout=3)
            assert srv.served == 1  # P answered; D refused
        finally:
            srv.close()


def test_version_is_5() -> None:
    assert HANDSHAKE_VERSION == 5


def _config(role: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": "P" if role == "kv_producer" else "D",
            "kv_lease_duration": 6.0,
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )


def _worker(role: str, caches: dict[str, torch.Tensor], **info: Any) -> Any:
    host = PluginHost()
    host.load()
    engine = EngineInfo(**{"block_size": 16, "model": "m", **info})
    worker = PDConnector.build_worker(_config(role), engine, 0, BuildContext(host=host))
    worker.register_kv_caches(caches)
    return worker


def _nhd(block: int = 16, heads: int = 2, head: int = 8, dtype: Any = torch.float16) -> Any:
    return {f"l{i}": torch.zeros(4, 2, block, heads, head, dtype=dtype) for i in range(2)}


_P = {"caches": _nhd(), "num_kv_heads": 2}
_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("same", {"caches": _nhd(), "num_kv_heads": 2}, ""),
    (
        "dtype",
        {"caches": _nhd(dtype=torch.bfloat16), "num_kv_heads": 2},
        r"dtype: this engine torch.float16, the peer torch.bfloat16",
    ),
    (
        "head_size",
        {"caches": _nhd(head=16), "num_kv_heads": 2},
        r"head size: this engine 8, the peer 16",
    ),
    ("block_size_x2", {"caches": _nhd(block=32), "num_kv_heads": 2, "block_size": 32}, ""),
    ("block_size_half", {"caches": _nhd(block=8), "num_kv_heads": 2, "block_size": 8}, ""),
    (
        "block_size",
        {"caches": _nhd(block=24), "num_kv_heads": 2, "block_size": 24},
        r"block size: this engine 16 tokens, the peer 24 tokens; KV moves between different "
        r"block sizes only when one is a whole multiple of the other: run both engines at one "
        r"block size \(16 or 24\)",
    ),
    (
        "num_kv_heads",
        {"caches": _nhd(heads=4), "num_kv_heads": 4},
        r"KV heads: this engine 2, the peer 4",
    ),
    (
        "order",
        {"caches": _nhd()},
        r"cache order: this engine NHD .*, the peer block-major \[blocks, \.\.\.\]",
    ),
]


@pytest.mark.parametrize(("name", "d", "expected"), _CASES, ids=[c[0] for c in _CASES])
def test_workers_refuse_each_layout_mismatch_and_prepare_nothing(
    name: str, d: dict[str, Any], expected: str
) -> None:
    p = _worker("kv_producer", _P["caches"], num_kv_heads=_P["num_kv_heads"])
    caches = d.pop("caches")
    consumer = _worker("kv_consumer", caches, **d)
    d["caches"] = caches
    try:
        server = p._server
        assert server is not None
        engines = consumer._engines
        entry = engines.ensure("P", 0, "127.0.0.1", server.port, time.monotonic())
        deadline = time.monotonic() + 10
        while entry.state is PeerState.CONNECTING and time.monotonic() < deadline:
            time.sleep(0.02)
            engines.poll(time.monotonic(), lambda _e: True)
        if not expected:
            assert entry.state is PeerState.READY
            assert entry.response is not None
            assert entry.response.kv_layout == p._kv_facts
            return
        assert entry.state is PeerState.FAILED
        assert entry.remote is None
        assert entry.peer is None
        # P refused it ("this engine" is P, "the peer" D); its message reached D whole.
        assert "KV layout mismatch with the decoder, nothing is read" in (entry.error or "")
        assert re.search(expected, entry.error or ""), entry.error
        assert server.rejected == 1
        assert server.served == 0
        assert re.search(expected, server.last_error or "")
        # D itself refuses P's facts, the values the other way round.
        with pytest.raises(IncompatiblePeerError, match="KV layout mismatch"):
            check_kv_layout(consumer._kv_facts, p._kv_facts, "the prefill engine")
    finally:
        consumer.shutdown()
        p.shutdown()


def test_d_scheduler_names_its_block_size_when_a_ticket_has_too_many_blocks() -> None:
    # P at block size 16 passes 4 blocks for 64 tokens; D at 32 expects 2 to 3. A ticket
    # whose block count happens to fit goes on to the handshake, refused there (above).
    from kvframe.errors import ConfigError
    from tests.pd.driver import view
    from tests.pd.test_hetero_tp_checks import _config as _sched_config
    from tests.pd.test_hetero_tp_checks import _ticket

    host = PluginHost()
    host.load()
    info = EngineInfo(block_size=32, model="m")
    sched = PDConnector.build_scheduler(_sched_config("kv_consumer"), info, BuildContext(host=host))
    ticket = _ticket(1, remote_block_ids=[[1, 2, 3, 4]], remote_num_tokens=64)
    with pytest.raises(
        ConfigError,
        match=r"has 4 blocks; 2 to 3 are expected for 64 tokens at "
        r"this engine's block size of 32 tokens \(the ticket names no remote_block_size",
    ):
        sched.check_request(view("r", 65, ticket))
    sched.check_request(view("r", 65, _ticket(1, remote_block_ids=[[1, 2]], remote_num_tokens=64)))
    # A ticket naming P's block size of 16: this engine's cache is block-major (no
    # num_kv_heads), which cannot be regrouped; refused before anything is allocated.
    with pytest.raises(
        ConfigError,
        match=r"remote_block_size = 16: block size: this engine 32 tokens, the peer 16 tokens; "
        r"a block-major cache cannot be cut",
    ):
        sched.check_request(view("r", 65, {**ticket, "remote_block_size": 16}))


def test_d_scheduler_counts_the_ticket_blocks_at_the_prefill_engines_block_size() -> None:
    from kvframe.errors import ConfigError
    from tests.pd.driver import view
    from tests.pd.test_hetero_tp_checks import _config as _sched_config
    from tests.pd.test_hetero_tp_checks import _ticket

    host = PluginHost()
    host.load()
    info = EngineInfo(block_size=32, model="m", num_kv_heads=2)
    sched = PDConnector.build_scheduler(_sched_config("kv_consumer"), info, BuildContext(host=host))
    p16 = _ticket(1, remote_block_ids=[[1, 2, 3, 4]], remote_num_tokens=64, remote_block_size=16)
    sched.check_request(view("r", 65, p16))  # 4 blocks of 16 for 64 tokens
    sched.check_request(view("r", 65, {**p16, "remote_block_ids": [[1, 2, 3, 4, 5]]}))  # +1
    for hostile in ([[1, 2]], [[1, 2, 3]], [[1, 2, 3, 4, 5, 6]]):
        with pytest.raises(
            ConfigError,
            match=rf"remote_block_ids\[0\] has {len(hostile[0])} blocks; 4 to 5 are expected "
            r"for 64 tokens at the prefill engine's block size of 16 tokens",
        ):
            sched.check_request(view("r", 65, {**p16, "remote_block_ids": hostile}))
    p64 = _ticket(1, remote_block_ids=[[7]], remote_num_tokens=64, remote_block_size=64)
    sched.check_request(view("r", 65, p64))
    with pytest.raises(ConfigError, match=r"this engine 32 tokens, the peer 48 tokens"):
        sched.check_request(view("r", 65, {**p64, "remote_block_size": 48}))
    for bad in (0, -16, True, "16", 1 << 21):
        with pytest.raises(ConfigError, match=r"kv_transfer_params.remote_block_size"):
            sched.check_request(view("r", 65, {**p64, "remote_block_size": bad}))


def test_p_refuses_a_push_request_without_facts_and_answers_a_pull_one() -> None:
    srv = _server(_facts())
    try:
        pull = HandshakeRequest(
            engine_id="D", rank=0, transport="inprocess", transport_metadata=b"m"
        )
        # The reader of a pull answer checks P's facts; here they come back to it.
        assert handshake("127.0.0.1", srv.port, pull, chash=CHASH).response.kv_layout == _facts()
        push = attrs.evolve(pull, layout=LAYOUT)
        with pytest.raises(IncompatiblePeerError, match="the decoder sent no KV layout"):
            handshake("127.0.0.1", srv.port, push, chash=CHASH, timeout=3)
        with pytest.raises(IncompatiblePeerError, match="head size: this engine 8, the peer 16"):
            handshake(
                "127.0.0.1",
                srv.port,
                attrs.evolve(push, kv_layout=_facts(head_size=16, layers=_layers((2, 16, 4, 16)))),
                chash=CHASH,
                timeout=3,
            )
    finally:
        srv.close()
