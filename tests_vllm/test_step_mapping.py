"""vLLM's SchedulerOutput → kvframe's SchedulerStep: per-request block ids, computed tokens
after the step (speculative tokens excluded), block hashes, resumed requests as new ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvframe_vllm.mapping import BlockHashCache, scheduler_step
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from kvframe.spi.request import block_hashes

BS = 16


def _new(req_id: str, blocks: list[int], computed: int) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(40)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=(blocks,),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _output() -> SchedulerOutput:
    cached = CachedRequestData(
        req_ids=["run", "back", "idle"],
        resumed_req_ids={"back"},
        new_token_ids=[[], [], []],
        all_token_ids={},
        new_block_ids=[([7],), ([1, 2, 3],), None],
        num_computed_tokens=[47, 0, 60],
        num_output_tokens=[7, 3, 20],
    )
    return SchedulerOutput(
        scheduled_new_reqs=[_new("fresh", [4, 5, 6], 16)],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"fresh": 24, "run": 3, "back": 40, "idle": 1},
        total_num_scheduled_tokens=68,
        scheduled_spec_decode_tokens={"run": [11, 12]},
        scheduled_encoder_inputs={},
        finished_req_ids={"gone"},
        free_encoder_mm_hashes=[],
    )


def test_scheduler_output_maps_to_per_request_step_state() -> None:
    tokens = list(range(1, 50))
    live = {"run": SimpleNamespace(request_id="run", all_token_ids=tokens, cache_salt=None)}
    step = scheduler_step(_output(), step=3, now=1.5, hashes=BlockHashCache(BS), requests=live)
    assert (step.step, step.now) == (3, 1.5)
    assert step.finished_request_ids == {"gone"}
    # A request back after preemption is scheduled anew: its old blocks were freed.
    assert step.new_requests == {"fresh": 24, "back": 40}
    assert step.cached_requests == {"run": 3, "idle": 1}
    assert step.new_block_ids == {"fresh": ((4, 5, 6),), "run": ((7,),), "back": ((1, 2, 3),)}
    # Speculative tokens may be rejected: only the verified one counts as computed.
    assert step.num_computed_tokens == {"fresh": 40, "run": 48, "back": 40, "idle": 61}
    assert step.block_hashes == {"run": block_hashes(tokens, BS)}


def test_without_live_requests_no_hashes_and_malformed_ids_are_rejected() -> None:
    step = scheduler_step(_output(), step=0, now=0.0)
    assert step.block_hashes == {}
    bad = _output()
    bad.scheduled_new_reqs[0].block_ids = ([-1],)
    with pytest.raises(ValueError, match="non-negative"):
        scheduler_step(bad, step=0, now=0.0)
