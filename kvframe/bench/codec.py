"""``kvframe bench codec``: the metadata codec against plain msgspec, and the issue's bar.

It measures, in one run and side by side, one **encode + decode** of:

- **empty_step**: the P/D connector's metadata for a step with nothing to do
  (:class:`~kvframe.connectors.pd.metadata.PDMetadata` with only ``step`` and ``now``);
- **loads_step**: the same with ``--loads`` loads (default 64), each a
  :class:`~kvframe.connectors.pd.metadata.PDLoad` of one KV group of ``--blocks`` blocks
  (default 4) from one remote engine, as the decode side sends them;

each through kvframe's codec (``codec_for(PDConnector, config)``: the envelope, typed decoding
into the attrs messages, the finishing pass) and through a plain msgspec reference: frozen
``msgspec.Struct`` types with the same fields in the same order and the same values (so both
write the same map; :func:`same_fields` checks the fields, and the run refuses to start if
they drift), one module-level ``msgspec.msgpack.Encoder`` and a typed ``Decoder`` (no envelope,
no checks beyond the types). The byte counts differ by kvframe's envelope and its
deterministic order of sets only.
Samples of the two alternate, so load on the machine hits both alike.

Human-readable table by default; ``--json`` prints one JSON object::

    {
      "benchmark": "codec",
      "params": {"loads": int, "blocks": int, "samples": int, "batch": int},
      "results": {
        "empty_step": {"kvframe_median_s": float, "kvframe_p90_s": float,
                       "msgspec_median_s": float, "msgspec_p90_s": float,
                       "ratio_median": float, "ratio_p90": float,
                       "bar_s": float, "meets_bar": bool,
                       "bar_ratio": float, "meets_bar_ratio": bool,
                       "kvframe_bytes": int, "msgspec_bytes": int},
        "loads_step": {... the same keys ...}
      }
    }

``*_median_s`` and ``*_p90_s`` are the median and 90th percentile of ``--samples`` samples,
each the mean seconds of one encode + decode over ``--batch`` back-to-back calls
(``loads_step`` takes a tenth of the samples, at least 5). ``ratio_*`` is
``kvframe / msgspec`` (below 1: kvframe is faster). ``bar_s`` is issue 18's bar (5 µs for the
empty step, 150 µs for 64 loads, scaled linearly for another ``--loads``); ``meets_bar`` is
``kvframe_median_s <= bar_s``. The issue measured msgspec at 0.6 µs and 74 µs for these
steps; ``bar_ratio`` is its bar over that (8.3 and 2.03), the bar on a machine as fast as
msgspec finds this one in this run, and ``meets_bar_ratio`` is ``ratio_median <= bar_ratio``
(the verdict that does not depend on how loaded the machine is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import attrs
import msgspec

from kvframe.bench._stats import p90
from kvframe.bench.progress import Progress
from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.connectors.pd.metadata import PDLoad, PDMetadata, RemoteEngineAddr
from kvframe.protocol.codec import Codec
from kvframe.spi.connector import codec_for

__all__ = ["add_arguments", "measure", "run", "same_fields"]

_BAR_EMPTY_S = 5e-6
_BAR_64_LOADS_S = 150e-6
# The msgspec figures the issue set its bars against (0.6 µs, 74 µs): the bars as ratios.
_BAR_RATIO_EMPTY = _BAR_EMPTY_S / 0.6e-6
_BAR_RATIO_LOADS = _BAR_64_LOADS_S / 74e-6


class _Addr(msgspec.Struct, frozen=True):
    engine_id: str
    host: str
    port: int
    tp_size: int
    ports: tuple[int, ...] = ()


class _Load(msgspec.Struct, frozen=True):
    request_id: str
    remote: _Addr
    remote_request_id: str
    local_block_ids: tuple[tuple[int, ...], ...]
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_incarnations: tuple[str, ...] = ()
    push_id: str = ""
    first_block: int = 0
    num_tokens: int = 0
    prompt_digest: str = ""
    kept_until: float | None = None
    remote_block_size: int = 0
    load_start: int = 0
    load_stop: int = 0


class _Step(msgspec.Struct, frozen=True):
    """PDMetadata's fields as a plain msgspec struct (the reference)."""

    step: int = 0
    loads: tuple[Any, ...] = ()
    saves: tuple[Any, ...] = ()
    free_request_ids: frozenset[str] = frozenset()
    abort_request_ids: frozenset[str] = frozenset()
    extra: dict[str, Any] = {}
    now: float = 0.0
    grants: tuple[Any, ...] = ()
    pd_heartbeats: dict[str, tuple[str, ...]] = {}
    pd_loads: tuple[_Load, ...] = ()
    releases: tuple[Any, ...] = ()
    engines: tuple[Any, ...] = ()
    push_sources: tuple[Any, ...] = ()
    push_abandoned: tuple[str, ...] = ()
    push_progress: tuple[Any, ...] = ()
    evictions: tuple[str, ...] = ()


# The reference's structs and the messages they stand for: same fields, same order, so both
# sides write the same map keys and values (checked by same_fields()).
_MIRRORS = ((_Addr, RemoteEngineAddr), (_Load, PDLoad), (_Step, PDMetadata))


def same_fields() -> bool:
    """True when each reference struct has exactly its message's fields, in order."""
    return all(
        [f.name for f in msgspec.structs.fields(ref)] == [f.name for f in attrs.fields(cls)]
        for ref, cls in _MIRRORS
    )


_REF_ENCODER = msgspec.msgpack.Encoder()
_REF_DECODER = msgspec.msgpack.Decoder(_Step)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (see the module docstring)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--loads", type=int, default=64, help="loads in the loads step (64)")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per load (4)")
    parser.add_argument("--samples", type=int, default=2000, help="samples per side (2000)")
    parser.add_argument("--batch", type=int, default=10, help="calls per sample (10)")


def _messages(loads: int, blocks: int) -> tuple[tuple[PDMetadata, _Step], tuple[PDMetadata, _Step]]:
    addr = RemoteEngineAddr(engine_id="prefill-0", host="10.0.0.1", port=5600, tp_size=1)
    ref_addr = _Addr(engine_id="prefill-0", host="10.0.0.1", port=5600, tp_size=1)
    ours, theirs = [], []
    for i in range(loads):
        local = (tuple(range(i * blocks, (i + 1) * blocks)),)
        remote = (tuple(range(10_000 + i * blocks, 10_000 + (i + 1) * blocks)),)
        rid, prid = f"cmpl-{i:032x}-0", f"cmpl-{i + 10**6:032x}-0"
        ours.append(
            PDLoad(
                request_id=rid,
                remote=addr,
                remote_request_id=prid,
                local_block_ids=local,
                remote_block_ids=remote,
            )
        )
        theirs.append(
            _Load(
                request_id=rid,
                remote=ref_addr,
                remote_request_id=prid,
                local_block_ids=local,
                remote_block_ids=remote,
            )
        )
    empty = (PDMetadata(step=7, now=1234.5), _Step(step=7, now=1234.5))
    full = (
        PDMetadata(step=8, now=1234.5, pd_loads=tuple(ours)),
        _Step(step=8, now=1234.5, pd_loads=tuple(theirs)),
    )
    return empty, full


def _sampler(
    encode: Callable[[Any], bytes], decode: Callable[[bytes], Any], msg: Any, batch: int
) -> Callable[[], float]:
    """One sample: the mean seconds of ``decode(encode(msg))`` over ``batch`` calls."""

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(batch):
            decode(encode(msg))
        return (time.perf_counter() - t0) / batch

    return sample


def _compare(
    codec: Codec,
    pair: tuple[PDMetadata, _Step],
    samples: int,
    batch: int,
    bar_s: float,
    bar_ratio: float,
) -> dict[str, Any]:
    ours, theirs = pair
    if (
        codec.decode(codec.encode(ours)) != ours
        or _REF_DECODER.decode(_REF_ENCODER.encode(theirs)) != theirs
    ):
        raise AssertionError("a round trip changed the message")
    k = _sampler(codec.encode, codec.decode, ours, batch)
    m = _sampler(_REF_ENCODER.encode, _REF_DECODER.decode, theirs, batch)
    for _ in range(max(1, samples // 20)):  # warm up both
        k(), m()
    ks: list[float] = []
    ms: list[float] = []
    for _ in range(samples):
        ks.append(k())
        ms.append(m())
    k_med, m_med, k_p90, m_p90 = statistics.median(ks), statistics.median(ms), p90(ks), p90(ms)
    return {
        "kvframe_median_s": k_med,
        "kvframe_p90_s": k_p90,
        "msgspec_median_s": m_med,
        "msgspec_p90_s": m_p90,
        "ratio_median": k_med / m_med if m_med > 0 else float("inf"),
        "ratio_p90": k_p90 / m_p90 if m_p90 > 0 else float("inf"),
        "bar_s": bar_s,
        "meets_bar": k_med <= bar_s,
        "bar_ratio": bar_ratio,
        "meets_bar_ratio": m_med > 0 and k_med / m_med <= bar_ratio,
        "kvframe_bytes": len(codec.encode(ours)),
        "msgspec_bytes": len(_REF_ENCODER.encode(theirs)),
    }


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("loads", "blocks", "samples", "batch"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    return None


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Run the measurements; returns the JSON object described in the module docstring."""
    if not same_fields():
        raise AssertionError("the msgspec reference's fields differ from the messages' fields")
    codec = codec_for(PDConnector, KVTransferConfig(kv_connector="PDConnector", kv_role="kv_both"))
    empty, full = _messages(args.loads, args.blocks)
    progress = Progress("codec", total=2)
    progress(f"empty step, {args.samples} samples of {args.batch}")
    empty_step = _compare(codec, empty, args.samples, args.batch, _BAR_EMPTY_S, _BAR_RATIO_EMPTY)
    progress(f"step of {args.loads} loads × {args.blocks} blocks")
    loads_step = _compare(
        codec,
        full,
        max(5, args.samples // 10),
        args.batch,
        _BAR_64_LOADS_S * args.loads / 64,
        _BAR_RATIO_LOADS,
    )
    return {
        "benchmark": "codec",
        "params": {
            "loads": args.loads,
            "blocks": args.blocks,
            "samples": args.samples,
            "batch": args.batch,
        },
        "results": {"empty_step": empty_step, "loads_step": loads_step},
    }


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:9.2f}"


def run(args: argparse.Namespace) -> int:
    """Print the comparison (``--json``: the JSON object); returns the exit status."""
    problem = _check_args(args)
    if problem is not None:
        print(f"kvframe bench codec: {problem}", file=sys.stderr)
        return 2
    report = measure(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    params: dict[str, int] = report["params"]  # type: ignore[assignment]
    results: dict[str, dict[str, Any]] = report["results"]  # type: ignore[assignment]
    print(
        f"metadata codec, encode + decode (µs; {params['samples']} samples of "
        f"{params['batch']} calls; loads step: {params['loads']} loads of "
        f"{params['blocks']} blocks)"
    )
    print(
        f"{'case':<11} {'kvframe med':>11} {'p90':>9} {'msgspec med':>11} {'p90':>9} "
        f"{'ratio med':>9} {'p90':>6} {'bar':>9} {'bar ratio':>9}  bytes (kvframe/msgspec)"
    )
    for name, r in results.items():
        print(
            f"{name:<11} {_us(r['kvframe_median_s']):>11} {_us(r['kvframe_p90_s'])} "
            f"{_us(r['msgspec_median_s']):>11} {_us(r['msgspec_p90_s'])} "
            f"{r['ratio_median']:9.2f} {r['ratio_p90']:6.2f} {_us(r['bar_s'])} "
            f"{r['bar_ratio']:9.2f}  {r['kvframe_bytes']}/{r['msgspec_bytes']}  "
            f"bar: {'met' if r['meets_bar'] else 'MISSED'}, "
            f"bar ratio: {'met' if r['meets_bar_ratio'] else 'MISSED'}"
        )
    return 0
