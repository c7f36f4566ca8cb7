"""Layout permutation on arrival (``allow_layout_permute``, issue 14 item 3), without engines:
the permutation against numpy's transposes over shapes and dtypes (Hypothesis), the handshake
rule (only an NHD/HND difference alone, at one tensor-parallel size, with the option), the
staging area's allocator and the options' validation. End to end over NIXL on the reference
engine: ``tests/refengine/test_layout_permute_nixl.py``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.connectors.pd.handshake import KVLayerFacts, KVLayoutFacts, check_kv_layout
from kvframe.connectors.pd.options import PDOptions
from kvframe.connectors.pd.peers import PeerState
from kvframe.connectors.pd.permute import (
    StagingArea,
    as_order,
    permutable,
    permute_blocks,
    permute_refusal,
)
from kvframe.errors import ConfigError, IncompatiblePeerError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float64]
_AXES = {"NHD": "tokens heads", "HND": "heads tokens"}


def _np_block(order: str, n: int, bs: int, heads: int, d: int, data: np.ndarray) -> np.ndarray:
    a, b = (bs, heads) if order == "NHD" else (heads, bs)
    return data.reshape(n, 2, a, b, d)


@given(
    n=st.integers(1, 4),
    bs=st.integers(1, 9),
    heads=st.integers(1, 5),
    d=st.integers(1, 6),
    dtype=st.sampled_from(_DTYPES),
    src=st.sampled_from(["NHD", "HND"]),
    dst=st.sampled_from(["NHD", "HND"]),
    seed=st.integers(0, 2**16),
)
def test_permute_blocks_equals_numpy_transpose(
    n: int, bs: int, heads: int, d: int, dtype: torch.dtype, src: str, dst: str, seed: int
) -> None:
    # The blocks as numpy holds them in ``src``'s order, transposed by numpy into ``dst``'s:
    # what permute_blocks gives, whether it sees elements or the bytes of them.
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randint(-100, 100, (n, 2 * bs * heads * d), generator=gen).to(dtype)
    as_bytes = flat.view(torch.uint8)
    raw = as_bytes.numpy().reshape(n, -1)
    itemsize = flat.element_size()
    block = _np_block(src, n, bs, heads, d * itemsize, raw)
    want = block if src == dst else np.transpose(block, (0, 1, 3, 2, 4))
    got = permute_blocks(as_bytes, src, dst, block_size=bs, heads=heads)
    assert got.shape == as_bytes.shape
    assert got.numpy().tobytes() == np.ascontiguousarray(want).tobytes()
    typed = permute_blocks(flat, src, dst, block_size=bs, heads=heads)
    assert typed.dtype == dtype
    assert typed.view(torch.uint8).numpy().tobytes() == got.numpy().tobytes()
    # And back: the two permutations are each other's inverse.
    back = permute_blocks(got, dst, src, block_size=bs, heads=heads)
    assert torch.equal(back, as_bytes)


def test_permute_blocks_refuses_what_it_cannot_permute() -> None:
    blocks = torch.zeros(2, 2 * 4 * 2 * 3)
    with pytest.raises(ValueError, match="cannot permute KV cache order 'block-major'"):
        permute_blocks(blocks, "block-major", "NHD", block_size=4, heads=2)
    with pytest.raises(ValueError, match=r"do not hold 2 x 5 tokens x 2 heads"):
        permute_blocks(blocks, "NHD", "HND", block_size=5, heads=2)


# -- the handshake rule ------------------------------------------------------------------------


def _facts(order: str = "NHD", **kw: Any) -> KVLayoutFacts:
    bs, heads, d = kw.pop("block_size", 16), kw.pop("heads", 4), kw.pop("head_size", 8)
    dtype = kw.pop("dtype", "torch.float16")
    shape = (2, bs, heads, d) if order == "NHD" else (2, heads, bs, d)
    if order == "block-major":
        shape = (2 * bs * heads * 8,)
    base: dict[str, Any] = {
        "order": order,
        "block_size": bs,
        "head_size": d,
        "num_kv_heads": heads,
        "kv_heads_per_rank": heads,
        "tp_size": 1,
        "layers": tuple(KVLayerFacts(name=f"l{i}", shape=shape, dtype=dtype) for i in range(2)),
    }
    return KVLayoutFacts(**{**base, **kw})


def test_as_order_swaps_tokens_and_heads_of_every_layer() -> None:
    hnd = as_order(_facts("NHD"), "HND")
    assert hnd == _facts("HND")
    assert as_order(hnd, "NHD") == _facts("NHD")
    with pytest.raises(ValueError, match="only NHD and HND"):
        as_order(_facts("NHD"), "block-major")


@pytest.mark.parametrize(("mine", "theirs"), [("NHD", "HND"), ("HND", "NHD")])
def test_an_order_difference_alone_passes_only_with_the_option(mine: str, theirs: str) -> None:
    assert permutable(_facts(mine), _facts(theirs))
    check_kv_layout(_facts(mine), _facts(theirs), "the prefill engine", permute=True)
    with pytest.raises(IncompatiblePeerError) as err:
        check_kv_layout(_facts(mine), _facts(theirs), "the prefill engine")
    text = str(err.value)
    assert f"cache order: this engine {mine} " in text
    assert f"the peer {theirs} " in text
    assert "set allow_layout_permute on the decoder" in text


@pytest.mark.parametrize(
    ("theirs", "expected"),
    [
        (
            _facts("HND", dtype="torch.bfloat16"),
            "dtype: this engine torch.float16, the peer torch.bfloat16",
        ),
        (_facts("HND", head_size=16), "head size: this engine 8, the peer 16"),
        (
            _facts("HND", block_size=32),
            "block size: this engine 16 tokens, the peer 32 tokens; allow_layout_permute "
            "permutes blocks of one size only (no block-size conversion at the same time)",
        ),
        (_facts("HND", heads=8), "KV heads: this engine 4, the peer 8"),
        (
            _facts("HND", tp_size=2, kv_heads_per_rank=2),
            "tensor-parallel size: this engine 1, the peer 2; allow_layout_permute needs equal",
        ),
        (
            _facts("block-major", head_size=0, num_kv_heads=0, kv_heads_per_rank=0),
            "the peer block-major [blocks, ...]; configure both engines' KV cache layout "
            "alike, or (NHD and HND only) set allow_layout_permute",
        ),
    ],
    ids=["dtype", "head_size", "block_size", "heads", "tp", "block-major"],
)
def test_anything_else_that_differs_is_still_refused_field_by_field(
    theirs: KVLayoutFacts, expected: str
) -> None:
    assert not permutable(_facts("NHD"), theirs)
    assert permute_refusal(_facts("NHD"), theirs)
    with pytest.raises(IncompatiblePeerError, match="KV layout mismatch") as err:
        check_kv_layout(_facts("NHD"), theirs, "the prefill engine", permute=True)
    assert expected in str(err.value)


def test_an_hnd_cache_at_another_tensor_parallel_size_is_refused_even_in_one_order() -> None:
    # Heterogeneous tensor parallelism reads head runs of NHD blocks only.
    mine = _facts("HND", tp_size=2, kv_heads_per_rank=2)
    with pytest.raises(IncompatiblePeerError, match="both caches are NHD"):
        check_kv_layout(mine, _facts("HND"), "the prefill engine", permute=True)
    check_kv_layout(_facts("NHD", tp_size=2, kv_heads_per_rank=2), _facts("NHD"), "the peer")


def test_equal_orders_need_no_permutation() -> None:
    assert not permutable(_facts("HND"), _facts("HND"))
    check_kv_layout(_facts("HND"), _facts("HND"), "the peer", permute=True)


# -- the staging area ---------------------------------------------------------------------------


def test_staging_area_gives_slots_until_full_and_takes_them_back() -> None:
    area = StagingArea(5)
    assert area.take("a", 3) == [0, 1, 2]
    assert area.take("b", 3) is None  # 2 free: waits
    assert area.free == 2
    assert area.take("c", 2) == [3, 4]
    area.give("a")
    area.give("a")  # nothing held any more: nothing happens
    assert area.free == 3
    assert sorted(area.take("b", 3) or []) == [0, 1, 2]
    assert area.holds("b")
    assert not area.holds("a")
    with pytest.raises(ValueError, match="already holds"):
        area.take("b", 1)
    with pytest.raises(ValueError, match="6 blocks do not fit a staging area of 5"):
        area.take("d", 6)
    with pytest.raises(ValueError, match="at least one slot"):
        StagingArea(0)


# -- options ------------------------------------------------------------------------------------


def test_options_default_off_and_are_validated() -> None:
    opts = PDOptions.from_extra({})
    assert opts.allow_layout_permute is False
    assert opts.permute_staging_blocks == 64
    on = PDOptions.from_extra({"allow_layout_permute": True, "permute_staging_blocks": 8})
    assert on.allow_layout_permute
    assert on.permute_staging_blocks == 8
    with pytest.raises(ConfigError, match="allow_layout_permute = 'yes'; expected true or false"):
        PDOptions.from_extra({"allow_layout_permute": "yes"})
    for bad in (0, -1, True, 1.5, 65537):
        with pytest.raises(ConfigError, match="permute_staging_blocks"):
            PDOptions.from_extra({"permute_staging_blocks": bad})


def test_engine_info_names_its_cache_order() -> None:
    assert EngineInfo(block_size=16).kv_cache_order == "NHD"
    assert EngineInfo(block_size=16, kv_cache_order="HND").kv_cache_order == "HND"
    with pytest.raises(ValueError, match="kv_cache_order"):
        EngineInfo(block_size=16, kv_cache_order="block-major")


# -- two real workers: the handshake between orders ------------------------------------------


def _worker(role: str, order: str, engine_id: str = "", **extra: Any) -> Any:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id or ("P" if role == "kv_producer" else "D"),
            "kv_lease_duration": 6.0,
            "kv_connector_extra_config": {"transport": "inprocess", **extra},
        }
    )
    host = PluginHost()
    host.load()
    engine = EngineInfo(block_size=16, model="m", num_kv_heads=2, kv_cache_order=order)
    worker = PDConnector.build_worker(config, engine, 0, BuildContext(host=host))
    shape = (4, 2, 16, 2, 8) if order == "NHD" else (4, 2, 2, 16, 8)
    worker.register_kv_caches({f"l{i}": torch.zeros(shape, dtype=torch.float16) for i in range(2)})
    return worker


def _connect(p: Any, d: Any) -> Any:
    engines = d._engines
    entry = engines.ensure("P", 0, "127.0.0.1", p._server.port, time.monotonic())
    deadline = time.monotonic() + 10
    while entry.state is PeerState.CONNECTING and time.monotonic() < deadline:
        time.sleep(0.02)
        engines.poll(time.monotonic(), lambda _e: True)
    return entry


def test_workers_of_two_orders_connect_only_with_the_option_and_p_never_pushes_into_d() -> None:
    p = _worker("kv_producer", "NHD")
    d = _worker("kv_consumer", "HND", allow_layout_permute=True, permute_staging_blocks=4)
    plain = _worker("kv_consumer", "HND", engine_id="D2")
    try:
        assert d._kv_facts.order == "HND"
        assert d._kv_facts.layers[0].shape == (2, 2, 16, 8)  # the whole model's, HND
        assert d._staging is not None
        assert d._staging.size == 4
        assert plain._staging is None
        entry = _connect(p, d)
        assert entry.state is PeerState.READY, entry.error
        assert entry.response.kv_layout.order == "NHD"
        assert d._permute_order(entry) == "NHD"
        p.progress()  # P adds the decoder's peer, without its layout: nothing is pushed into it
        assert p._reader_layouts == {}
        refused = _connect(p, plain)
        assert refused.state is PeerState.FAILED
        assert refused.remote is None
        assert "cache order: this engine HND" in (refused.error or "")
        assert "set allow_layout_permute on the decoder" in (refused.error or "")
    finally:
        plain.shutdown()
        d.shutdown()
        p.shutdown()


def test_a_cache_not_in_the_engines_order_is_refused_at_registration() -> None:
    host = PluginHost()
    host.load()
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": "kv_consumer",
            "engine_id": "D",
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )
    info = EngineInfo(block_size=16, model="m", num_kv_heads=2, kv_cache_order="HND")
    worker = PDConnector.build_worker(config, info, 0, BuildContext(host=host))
    nhd = {"l0": torch.zeros(4, 2, 16, 2, 8)}
    try:
        with pytest.raises(ValueError, match=r"needs a contiguous \[blocks, 2, 2, 16, head_dim\] "):
            worker.register_kv_caches(nhd)
    finally:
        worker.shutdown()
