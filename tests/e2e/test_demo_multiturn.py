"""`kvframe demo --multi-turn --json`: a three-turn conversation over real NIXL.

Both engines are kv_both; D keeps each turn's KV and P pulls it on the next turn (bidirectional
mode): every turn's output equals a single engine's, turns two and three pulled their history
from D, the leak oracle passes on P, and D frees the last turn's kept KV at its ttl.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("nixl_cu12", reason="the demo runs over NIXL")
pytest.importorskip("kvframe_refengine", reason="the demo needs contrib/kvframe-refengine")

from tests.e2e.test_demo import run_demo_json


def test_multi_turn_demo_passes_every_check() -> None:
    result = run_demo_json("--multi-turn")
    assert result["multi_turn"] is True
    assert result["mode"] == "pull"
    turns = result["conversation"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(t["equal_to_single_engine"] for t in turns)
    assert all(t["kept_by_d"] for t in turns)
    assert not turns[0]["history_sent"]
    assert not turns[0]["history_pulled"]
    for before, t in itertools.pairwise(turns):
        assert t["history_sent"]
        assert t["history_pulled"]
        assert not t["history_refused"]
        assert t["tokens_pulled"] > 0
        # D held the previous prompt and answer (but its last token): P had all of it.
        held = before["prompt_tokens"] + len(before["token_ids"]) - 1
        assert t["tokens_pulled"] + t["tokens_cached_on_p"] == held
        assert t["ttft_s"] > 0
    ttl = result["decoder_kv_blocks_ttl_s"]
    assert ttl == 3 * result["lease_duration_s"]
    assert result["conversation"]["kept_freed_after_s"] <= ttl + 2.0


def test_max_tokens_too_long_for_the_conversation_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvframe_refengine.demo import main

    assert main(["--multi-turn", "--max-tokens", "1500"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("kvframe demo: --max-tokens 1500: expected 1..")
    assert "with --multi-turn" in err
    assert out == ""
