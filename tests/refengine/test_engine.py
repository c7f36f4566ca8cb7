"""The engine without a connector: paged attention equals the dense reference, prefix caching
changes nothing but the work done, bad input is refused clearly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvframe_refengine import (
    Engine,
    EngineConfig,
    FinishReason,
    LeakError,
    ModelConfig,
    TinyLM,
    greedy_reference,
)
from kvframe_refengine.tokenizer import decode, encode

MODEL = ModelConfig(seed=7)
_REF = TinyLM(MODEL)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def _engine(**kw: object) -> Engine:
    base: dict[str, object] = {"model": MODEL, "block_size": 4, "num_blocks": 96}
    base.update(kw)
    return Engine(EngineConfig(**base))  # type: ignore[arg-type]


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    again = TinyLM(MODEL)
    assert torch.equal(again.layers[2]["wk"], _REF.layers[2]["wk"])
    assert not torch.equal(TinyLM(ModelConfig(seed=8)).embed, _REF.embed)


def test_paged_logits_equal_dense_logits() -> None:
    # One sequence prefilled in chunks through a scrambled block table: the last-token logits
    # match the dense pass at every chunk boundary.
    tokens = _prompt(1, 23)
    dense = _REF.forward_dense(tokens)
    from kvframe_refengine.model import PagedBatch, SeqSlice

    bs = 4
    caches = [torch.zeros(_REF.kv_cache_shape(16, bs)) for _ in range(MODEL.num_layers)]
    table = torch.tensor([9, 3, 14, 0, 7, 11])
    done = 0
    for end in (5, 6, 13, 23):
        pos = torch.arange(done, end)
        batch = PagedBatch(
            token_ids=torch.tensor(tokens[done:end]),
            positions=pos,
            slot_mapping=table[pos // bs] * bs + pos % bs,
            seqs=(SeqSlice(start=0, end=end - done, context_len=end, block_table=table),),
        )
        logits = _REF.forward_paged(batch, caches)
        torch.testing.assert_close(logits[0], dense[end - 1], rtol=1e-5, atol=1e-5)
        done = end


@pytest.mark.parametrize("chunk", [512, 7])
def test_engine_matches_dense_reference_token_for_token(chunk: int) -> None:
    # Prompts of 1 token, a partial block, exact blocks and several blocks, batched together;
    # chunk=7 forces chunked prefill mixed with decodes of other requests.
    lengths = [1, 3, 8, 13, 30]
    prompts = [_prompt(10 + n, n) for n in lengths]
    engine = _engine(max_num_batched_tokens=chunk)
    outs = engine.generate(prompts, max_tokens=6)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finished
        assert out.finish_reason is FinishReason.LENGTH
        assert list(out.token_ids) == greedy_reference(_REF, prompt, 6)
    engine.check_no_leaks()


def test_continuous_batching_with_late_arrivals() -> None:
    engine = _engine(max_num_seqs=2)
    prompts = {f"r{i}": _prompt(40 + i, 5 + 3 * i) for i in range(4)}
    engine.add_request("r0", prompts["r0"], 5)
    engine.add_request("r1", prompts["r1"], 9)
    got: dict[str, list[int]] = {}
    finished = set()
    for step in range(200):
        if step == 2:
            engine.add_request("r2", prompts["r2"], 4)
        if step == 3:
            engine.add_request("r3", prompts["r3"], 7)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        # Never more than max_num_seqs running at once.
        assert len(engine.scheduler.running) <= 2
        if len(finished) == 4:
            break
    lengths = {"r0": 5, "r1": 9, "r2": 4, "r3": 7}
    for rid, prompt in prompts.items():
        assert got[rid] == greedy_reference(_REF, prompt, lengths[rid])
    engine.check_no_leaks()


def test_prefix_caching_same_output_fewer_tokens() -> None:
    shared = _prompt(3, 17)
    prompts = [shared + _prompt(4, 5), shared + _prompt(5, 2), shared]
    cold = _engine(enable_prefix_caching=False)
    warm = _engine()
    cold_out = cold.generate(prompts, 4)
    warm.generate([shared], 1)
    before = warm.scheduler.counters["tokens_computed"]
    warm_out = warm.generate(prompts, 4)
    assert [o.token_ids for o in warm_out] == [o.token_ids for o in cold_out]
    for p, o in zip(prompts, warm_out, strict=True):
        assert list(o.token_ids) == greedy_reference(_REF, p, 4)
    # 16 of the 17 shared tokens are 4 full blocks (block 5 is partial); the last prompt token
    # of the third prompt is never taken from the cache.
    assert [o.num_cached_tokens for o in warm_out] == [16, 16, 16]
    computed = warm.scheduler.counters["tokens_computed"] - before
    assert computed == sum(len(p) for p in prompts) - 3 * 16 + 3 * 3
    assert cold.scheduler.counters["prefix_hit_tokens"] == 0
    cold.check_no_leaks()
    warm.check_no_leaks()


def test_eviction_under_pressure_stays_correct() -> None:
    # A pool so small that every batch evicts cached blocks of the previous one.
    engine = _engine(num_blocks=12, max_num_seqs=2)
    prompts = [_prompt(60 + i, 14) for i in range(6)]
    for _ in range(2):
        outs = engine.generate(prompts, 3)
        for p, o in zip(prompts, outs, strict=True):
            assert list(o.token_ids) == greedy_reference(_REF, p, 3)
    assert engine.pool.num_evictions > 0
    engine.check_no_leaks()


# Each example builds an engine and runs a dense reference per token: keep the count low.
@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    max_tokens=st.integers(1, 4),
    block_size=st.sampled_from([1, 3, 4, 16]),
    chunk=st.integers(1, 40),
)
def test_any_batch_matches_reference(
    lengths: list[int], max_tokens: int, block_size: int, chunk: int
) -> None:
    prompts = [_prompt(100 + i * 31 + n, n) for i, n in enumerate(lengths)]
    engine = _engine(block_size=block_size, num_blocks=128, max_num_batched_tokens=chunk)
    outs = engine.generate(prompts, max_tokens)
    for p, o in zip(prompts, outs, strict=True):
        assert list(o.token_ids) == greedy_reference(_REF, p, max_tokens)
    engine.check_no_leaks()


def test_abort_and_leak_oracle() -> None:
    engine = _engine()
    engine.add_request("a", _prompt(1, 9), 50)
    engine.step()
    with pytest.raises(LeakError, match="live requests: \\['a'\\]"):
        engine.check_no_leaks()
    assert engine.abort("a")
    assert not engine.abort("a")
    assert not engine.abort("never-seen")
    (out,) = engine.step()
    assert out.finished
    assert out.finish_reason is FinishReason.ABORT
    assert len(out.token_ids) == 1
    engine.check_no_leaks()
    engine.shutdown()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        (("", [1], 1), ValueError, "request_id"),
        (("x", [], 1), ValueError, "prompt is empty"),
        (("x", [1, 512], 1), ValueError, "512"),
        (("x", [1, -1], 1), ValueError, "-1"),
        (("x", [1], 0), ValueError, "max_tokens"),
        (("x", [1] * 60, 10), ValueError, "max_model_len"),
        (("x", [1] * 30, 20), ValueError, "raise EngineConfig.num_blocks"),
        (("x", [1], 1, [("a", 1)]), TypeError, "mapping"),
    ],
)
def test_bad_requests_are_refused_clearly(args: tuple, err: type, match: str) -> None:  # type: ignore[type-arg]
    engine = _engine(num_blocks=10, max_model_len=64)
    with pytest.raises(err, match=match):
        engine.add_request(*args)
    engine.check_no_leaks()


def test_duplicate_live_id_is_refused() -> None:
    engine = _engine()
    engine.add_request("x", [1, 2], 3)
    with pytest.raises(ValueError, match="still in use"):
        engine.add_request("x", [1, 2], 3)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig(num_heads=8, num_kv_heads=3)
    with pytest.raises(ValueError, match="even head_dim"):
        ModelConfig(head_dim=31)


def test_tokenizer_round_trip() -> None:
    assert decode(encode("héllo")) == "héllo"
    assert decode([104, 105, 300]) == "hi<300>"


def test_admission_counts_free_cached_hits_as_taken() -> None:
    # A free cached block that a request takes back is no longer free for anyone else: an
    # admission check that forgot it would over-admit and run out of blocks mid-flight.
    engine = _engine(num_blocks=10)
    shared = _prompt(70, 16)
    engine.generate([[*shared, 1]], 1)  # leaves 4 cached free blocks
    engine.add_request("x", _prompt(71, 13), 4)  # holds 4 blocks
    engine.step()
    engine.add_request("b", [*shared, *_prompt(72, 13)], 4)  # 8 blocks, 4 of them cached
    order: list[str] = []
    for out in engine.run_until_idle():
        if out.finished:
            order.append(out.request_id)
        if out.request_id == "b" and out.finished:
            assert list(out.token_ids) == greedy_reference(_REF, [*shared, *_prompt(72, 13)], 4)
            assert out.num_cached_tokens == 16
    assert order == ["x", "b"]
    engine.check_no_leaks()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_cpu_reference() -> None:
    # Weights are drawn on the CPU and moved, so the CUDA engine runs the same model.
    engine = _engine(device="cuda")
    assert engine.runner.kv_caches[0].is_cuda
    prompts = [_prompt(80, 3), _prompt(81, 14)]
    for p, o in zip(prompts, engine.generate(prompts, 5), strict=True):
        assert list(o.token_ids) == greedy_reference(_REF, p, 5)
    engine.check_no_leaks()
