"""`kvframe bench multiturn --quick --json`: the output's shape and that the pull arm pulled its
history from D while the recompute arm recomputed it (never its timings); each sample's checks,
against scripted engines."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvframe import cli

pytest.importorskip("nixl_cu12", reason="the benchmark moves KV over NIXL")
pytest.importorskip("kvframe_refengine")


def test_quick_json_shape_and_the_pull_arm_pulled() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "bench", "multiturn", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "multiturn"
    assert report["version"] == 1
    assert report["quick"] is True
    repeats = report["repeats"]
    assert repeats == 1
    pin = report["pinning"]
    assert pin["verified"] is True
    assert len(pin["P"]) == len(pin["D"]) == 1
    assert set(pin["threads"]) == {"P", "D"}
    assert set(report["load_average"]) == {"start", "end"}
    per_token = report["model"]["kv_bytes_per_token"]
    block = report["model"]["block_size"]
    answer, message = report["answer_tokens"], report["message_tokens"]
    (case,) = report["cases"]
    h = case["history_tokens"]
    kept = h + answer - 1  # the last answer token has no KV
    prompt = h + answer + message
    assert case["kept_tokens"] == kept
    assert case["prompt_tokens"] == prompt
    # P READs the whole blocks of the kept tokens from D.
    assert case["kv_bytes"] == -(-kept // block) * block * per_token
    assert set(case["arms"]) == {"pull", "recompute"}
    for arm, a in case["arms"].items():
        for key in ("ttft_s", "prefill_s", "tail_s"):
            s = a[key]
            assert len(s["samples"]) == repeats, (arm, key)
            assert s["median"] <= s["p90"] or s["median"] == pytest.approx(s["p90"])
        assert 0 < a["prefill_s"]["median"] < a["ttft_s"]["median"]
        moved = a["moved"]
        assert moved["requests"] == repeats
        assert moved["d_external_tokens"] == repeats * (prompt - 1), arm  # D loaded from P
    pull, rec = case["arms"]["pull"]["moved"], case["arms"]["recompute"]["moved"]
    assert pull["history_loads"] == pull["loads_done"] == repeats
    assert pull["bytes"] == repeats * case["kv_bytes"]
    assert pull["pulled_tokens"] == repeats * kept
    assert pull["computed_tokens"] == repeats * (prompt - kept)
    assert rec["history_loads"] == rec["loads_done"] == rec["bytes"] == rec["pulled_tokens"] == 0
    assert rec["computed_tokens"] == repeats * prompt
    assert case["history_load_s"]["median"] > 0
    ttft = {arm: a["ttft_s"]["median"] for arm, a in case["arms"].items()}
    prefill = {arm: a["prefill_s"]["median"] for arm, a in case["arms"].items()}
    assert case["speedup"] == pytest.approx(ttft["recompute"] / ttft["pull"])
    assert case["prefill_speedup"] == pytest.approx(prefill["recompute"] / prefill["pull"])


def test_repeats_must_be_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "multiturn", "--repeats", "-3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--repeats: '-3': expected a whole number of rounds >= 1" in err


# -- each sample's checks, against scripted engines ------------------------------------------


class _Engine:
    """Answers the benchmark's calls as an engine would: ``pulls`` (P: a kv_history is pulled),
    ``keeps`` (D: keep_for_next_turn is honoured)."""

    def __init__(self, name: str, *, pulls: bool = True, keeps: bool = True) -> None:
        self.name = name
        self.pulls = pulls
        self.keeps = keeps
        self.counters: dict[str, float] = {}
        self.held = 0  # D: the kept turn
        self._next: dict[str, Any] = {}

    def log_tail(self) -> str:
        return "(scripted)"

    def ask(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        self.send(method, path, body)
        return self.receive(path)

    def send(self, method: str, path: str, body: dict[str, Any] | None = None) -> None:
        if path == "/stats":
            idle = {"waiting": 0, "loading": 0, "running": 0, "held": self.held}
            self._next = {
                "engine": {**idle, "connector_pending": False},
                "connector": {"counters": dict(self.counters)},
                "connector_scheduler": {"counters": {}},
            }
            return
        assert body is not None
        prompt, params = body["prompt"], body["kv_transfer_params"]
        external = len(prompt) - 1 if "remote_engine_id" in params else 0
        kept: dict[str, Any] | None = None
        self.held = 0
        if "kv_history" in params and self.pulls:
            external = params["kv_history"]["remote_num_tokens"]
            for key, n in (("history_loads", 1), ("loads_done", 1), ("bytes_read", 2**20)):
                self.counters[key] = self.counters.get(key, 0) + n
        tokens = list(range(body["max_tokens"]))
        if params.get("keep_for_next_turn") and self.keeps:
            kept = {"do_remote_prefill": True, "kept_until": 1.0}
            kept["remote_num_tokens"] = len(prompt) + len(tokens) - 1
            self.held = 1
        if params.get("do_remote_decode"):
            kept = {"do_remote_prefill": True, "remote_engine_id": self.name}
        self._next = {
            "choices": [{"token_ids": tokens}],
            "kv_transfer_params": kept,
            "usage": {"external_tokens": external, "cached_tokens": 0},
        }

    def receive(self, what: str) -> dict[str, Any]:
        return self._next


def _sample(p: _Engine, d: _Engine, pull: bool) -> Any:
    from kvframe_refengine import bench_multiturn as mt

    return mt._turn_two(p, d, list(range(100)), 1, pull=pull)  # type: ignore[arg-type]


def test_a_sample_counts_what_moved() -> None:
    s = _sample(_Engine("P"), _Engine("D"), pull=True)
    assert (s.kept_tokens, s.pulled_tokens, s.prompt_tokens) == (115, 115, 148)
    assert (s.computed_tokens, s.d_external_tokens, s.history_loads) == (33, 147, 1)
    s = _sample(_Engine("P"), _Engine("D"), pull=False)
    assert (s.kept_tokens, s.pulled_tokens, s.computed_tokens, s.loads_done) == (0, 0, 148, 0)


def test_a_pull_arm_whose_p_recomputed_is_an_error() -> None:
    from kvframe_refengine.bench_push import BenchError

    with pytest.raises(BenchError, match="pull: expected P to pull the 115 tokens D kept, but P "
                       "counted 0 external and 0 cached tokens of a 148-token prompt"):  # fmt: skip
        _sample(_Engine("P", pulls=False), _Engine("D"), pull=True)
    with pytest.raises(BenchError, match="D kept no history of turn one"):
        _sample(_Engine("P"), _Engine("D", keeps=False), pull=True)


def test_figures_and_table_from_samples() -> None:
    from kvframe_refengine import bench_multiturn as mt

    def samples(ttft: float, prefill: float, pulled: int) -> list[Any]:
        return [
            mt._Sample(ttft + i, prefill + i, kept_tokens=111, prompt_tokens=144,
                       pulled_tokens=pulled, computed_tokens=144 - pulled, load_s=0.25,
                       bytes=2.0**21 if pulled else 0.0)
            for i in range(3)
        ]  # fmt: skip

    case = mt._case(96, {"pull": samples(4.0, 3.0, 111), "recompute": samples(8.0, 6.0, 0)})
    assert case["arms"]["pull"]["ttft_s"]["median"] == 5.0
    assert case["arms"]["recompute"]["tail_s"]["samples"] == [2.0, 2.0, 2.0]
    assert case["speedup"] == pytest.approx(9.0 / 5.0)
    assert case["prefill_speedup"] == pytest.approx(7.0 / 4.0)
    assert case["history_load_s"]["median"] == 0.25
    assert case["arms"]["pull"]["moved"]["computed_tokens"] == 3 * 33
    assert case["kv_bytes"] == 2.0**21
    report = {
        "repeats": 3,
        "answer_tokens": 16,
        "message_tokens": 32,
        "pinning": {"P": [0], "D": [1]},
        "load_average": {"start": 0.1, "end": 0.2},
        "cases": [case],
    }
    table = mt._table(report)
    assert "| 96 tokens | 2.0 MiB | 5000.0 / " in table
    assert "| 1.80x | 4000.0 / " in table
