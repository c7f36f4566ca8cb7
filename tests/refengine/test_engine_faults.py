"""Faults inside the engine: a request id the connectors cannot carry is refused when it is
added; an exception raised while stepping ends the requests it concerns with an error and the
engine keeps serving; the scheduler half's connector counters add up over the engine's life."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig
from kvframe_refengine.engine import MAX_REQUEST_ID_BYTES

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.request import RequestView
from tests.refengine.test_engine_connector import _engine as _fake_engine
from tests.refengine.test_engine_connector import _prefill

MODEL = ModelConfig(seed=5)
_ids = itertools.count()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def _plain(**kw: Any) -> Engine:
    return Engine(EngineConfig(model=MODEL, block_size=8, num_blocks=64, **kw))


def _break_execute(engine: Engine, times: int | None = 1, *, only_busy: bool = False) -> list[int]:
    """Make the runner raise on its next ``times`` calls (None: always); returns a call log."""
    real = engine.runner.execute
    log: list[int] = []

    def execute(batch: Any) -> Any:
        if (times is None or len(log) < times) and (batch.seqs or not only_busy):
            log.append(batch.step)
            raise RuntimeError(f"injected fault in step {batch.step}")
        return real(batch)

    engine.runner.execute = execute  # type: ignore[method-assign]
    return log


# -- request ids --------------------------------------------------------------------------------


def test_the_request_id_limit_is_128_bytes() -> None:
    assert MAX_REQUEST_ID_BYTES == 128


@pytest.mark.parametrize(
    ("rid", "words"),
    [
        ("x" * 240, ["240", "128", "shorter"]),
        ("é" * 65, ["130", "128"]),
        ("", ["empty"]),
        ("a\tb", ["printable"]),
        ("\ud800", ["printable"]),
        (5, ["int", "str"]),
    ],
    ids=["240-ascii", "130-bytes-utf8", "empty", "tab", "lone-surrogate", "int"],
)
def test_add_request_refuses_an_id_the_connectors_cannot_carry(rid: Any, words: list[str]) -> None:
    with _plain() as engine:
        with pytest.raises(ValueError, match="request_id") as info:
            engine.add_request(rid, [1, 2, 3], 2)
        for word in words:
            assert word in str(info.value)
        assert not engine.scheduler.requests  # unchanged
        engine.add_request("r" * MAX_REQUEST_ID_BYTES, [1, 2, 3], 2)
        engine.add_request("é" * (MAX_REQUEST_ID_BYTES // 2), [1, 2, 3], 2)
        engine.run_until_idle()
        engine.check_no_leaks()


# -- a step that raises ---------------------------------------------------------------------------


def test_a_step_that_raises_fails_its_requests_and_the_engine_keeps_serving() -> None:
    with _plain() as engine:
        engine.add_request("a", _prompt(1, 9), 3)
        engine.add_request("b", _prompt(2, 5), 3)
        _break_execute(engine)
        outs = engine.step()  # does not raise
        assert sorted((o.request_id, o.finish_reason) for o in outs) == [
            ("a", FinishReason.ERROR),
            ("b", FinishReason.ERROR),
        ]
        for out in outs:
            assert out.error is not None
            assert "RuntimeError: injected fault in step" in out.error
        assert engine.num_failed_steps == 1
        assert engine.describe()["failed_steps"] == 1
        engine.check_no_leaks()  # their blocks were freed
        (again,) = engine.generate([_prompt(1, 9)], max_tokens=3)
        assert again.finish_reason is FinishReason.LENGTH
        assert len(again.token_ids) == 3
        engine.check_no_leaks()


def test_a_failure_that_repeats_ends_the_queued_requests_too() -> None:
    with _plain(max_num_seqs=1) as engine:
        engine.add_request("running", _prompt(1, 9), 3)
        engine.add_request("queued", _prompt(2, 9), 3)
        _break_execute(engine, times=None)
        first = engine.step()
        assert [(o.request_id, o.finish_reason) for o in first] == [("running", FinishReason.ERROR)]
        second = engine.step()  # "queued" was admitted and failed, or failed in the queue
        assert [(o.request_id, o.finish_reason) for o in second] == [("queued", FinishReason.ERROR)]
        assert not engine.has_unfinished_work()
        engine.check_no_leaks()


def test_a_failing_step_fails_the_requests_whose_kv_is_being_loaded(
    host: PluginHost, store: str
) -> None:
    """The connector's worker half acts for loading requests during every step, also a step that
    runs nothing: they are the ones a failure there concerns."""
    prompt = _prompt(9, 10)
    p = _fake_engine(host, store, "kv_producer", lease_steps=20)
    d = _fake_engine(host, store, "kv_consumer", load_steps=20)
    params = _prefill(p, "r", prompt)
    p.step()  # P publishes the KV
    d.add_request("r", prompt, 3, params)
    d.step()
    assert "r" in d.scheduler.loading
    worker = d.connector_worker
    assert worker is not None
    real = worker.start_load_kv
    calls: list[int] = []

    def start_load_kv(ctx: Any) -> None:
        if not calls:
            calls.append(1)
            raise ValueError("injected: the load could not be posted")
        real(ctx)

    worker.start_load_kv = start_load_kv  # type: ignore[method-assign,assignment]
    outs = d.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", FinishReason.ERROR)]
    assert outs[0].error is not None
    assert "injected: the load could not be posted" in outs[0].error
    assert "waiting for its KV" in outs[0].error
    d.run_until_idle()
    d.check_no_leaks()
    p.run_until_idle()
    p.check_no_leaks()


# -- connector statistics -----------------------------------------------------------------------


def _pd_consumer() -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": "kv_consumer",
            "engine_id": f"faults-D{next(_ids)}",
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )
    host = PluginHost(autoload=False, env={})
    host.load()
    return Engine(EngineConfig(model=MODEL, block_size=8), kv, plugin_host=host)


def test_scheduler_connector_counters_accumulate_across_reads() -> None:
    with _pd_consumer() as d:
        d.generate([[1, 2, 3]], max_tokens=1)  # warm up: nothing counted as bad
        for n in (1, 2):
            # The engine refuses such a request at admission (check_request, HTTP 400 through
            # the server); the scheduler half still counts one that reaches it another way.
            with pytest.raises(ConfigError, match="remote_block_ids is missing"):
                d.add_request(f"bad-{n}", [1, 2, 3], 1, {"do_remote_prefill": True})
            assert d.connector_scheduler is not None
            d.connector_scheduler.on_new_request(
                RequestView(
                    request_id=f"bad-{n}",
                    num_prompt_tokens=3,
                    kv_transfer_params={"do_remote_prefill": True},
                )
            )
            d.run_until_idle()
            assert d.connector_stats()["bad_params"] == n
            assert d.connector_stats()["bad_params"] == n  # a read does not reset it
            sched = d.connector_scheduler_stats()
            assert sched.counters["bad_params"] == n
            assert "scheduler_leases_held" in sched.gauges
