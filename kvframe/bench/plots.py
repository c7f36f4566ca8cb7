"""The benchmarks' figures in the docs, drawn with matplotlib from the benchmarks' own JSON.

::

    python -m kvframe.bench.plots [--data DIR] [--out DIR] [--run [--quick]]

reads ``DIR/NAME.json`` — what ``kvframe bench NAME --json`` printed, unchanged — for each
NAME in :data:`FIGURES` that has a file there, and writes ``OUT/NAME.svg``: each benchmark's
kvframe figures beside its reference from the same run. The defaults are the docs' own,
``docs/assets/plots/data`` and ``docs/assets/plots``. Every figure's footer names the command
and parameters of the run it shows, and its date and load average when ``DIR/runs.json``
records them.

``--run`` first runs every benchmark (``kvframe bench NAME --json``, one after the other; the
full sizes, which take minutes, or the small ones with ``--quick``, whose figures show the
shape only) and writes its JSON and ``runs.json`` (command, date, the load average before and
after, CPU count) into ``DIR``; a benchmark that fails is reported and keeps its old data.
Run it on a quiet machine: figures from a busy one mostly show the other work.

Exit status 0; 1 when ``--run`` had a benchmark fail; 2 when there is nothing to draw or a
data file is not a benchmark's JSON (the message names the file and what is wrong).
matplotlib is needed (``pip install matplotlib``; it is in kvframe's ``dev`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["FIGURES", "PlotError", "data_digest", "draw", "main", "run_benchmarks"]

_ROOT = Path(__file__).resolve().parents[2]
_DATA = _ROOT / "docs" / "assets" / "plots" / "data"
_OUT = _ROOT / "docs" / "assets" / "plots"

#: The benchmarks drawn, in order, with the arguments ``--run`` passes to each (full, quick).
FIGURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "transfer": ((), ("--quick",)),
    "pipeline": ((), ("--quick",)),
    "lease": ((), ("--scale", "0.1")),
    "codec": ((), ("--samples", "500")),
    "offload": ((), ("--quick",)),
}

_KVFRAME = "#3f51b5"
_REFERENCE = "#9e9e9e"
_OTHER = ("#ff9800", "#009688", "#e91e63", "#795548")


class PlotError(Exception):
    """A data file cannot be drawn: the message names it and what is wrong."""


def _get(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            raise PlotError(f"no {'.'.join(keys)!r} in it")
        data = data[key]
    return data


def _size(n: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _ratio(r: float) -> str:
    return f"{r:,.0f}×" if r >= 100 else f"{r:.3g}×"


def _bars(ax: Axes, labels: Sequence[str], series: Mapping[str, Sequence[float]]) -> None:
    """Grouped vertical bars: one group per label, one bar per series."""
    colours = [_KVFRAME, _REFERENCE, *_OTHER]
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, values, width, label=name, color=colours[i % len(colours)])
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.legend(fontsize=8, framealpha=0.9)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _transfer(fig: Figure, data: Any) -> None:
    rows = _get(data, "throughput")
    methods = [m for m in _get(data, "methods") if all(m in r["results"] for r in rows)]
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    labels = [f"{_size(r['block_bytes'])}\n× {r['blocks']}" for r in rows]
    _bars(left, labels, {m: [r["results"][m]["gbps"] for r in rows] for m in methods})
    left.set_ylabel("GB/s (median)")
    left.set_title("Cross-process READ per request size", fontsize=10)
    costs = _get(data, "post_cost")
    ds = [c["descriptors"] for c in costs]
    keys = [k for k in costs[0] if k != "descriptors" and all(c.get(k) is not None for c in costs)]
    for i, key in enumerate(keys):
        colour = _KVFRAME if i == 0 else [_REFERENCE, *_OTHER][(i - 1) % 5]
        right.plot(ds, [c[key] for c in costs], marker="o", label=key.removesuffix("_us"), c=colour)
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("descriptors per request")
    right.set_ylabel("µs per request")
    right.set_title("Cost of posting one request", fontsize=10)
    right.legend(fontsize=7, frameon=False)
    right.grid(alpha=0.3)


def _pipeline(fig: Figure, data: Any) -> None:
    cases = _get(data, "cases")
    ax = fig.subplots()
    labels = [
        f"{c['prefix_tokens']} + {c['suffix_tokens']}\n{_size(c['kv_bytes'])} KV" for c in cases
    ]
    names = {
        "layer by layer": "layerwise_s",
        "whole, then compute": "whole_s",
        "compute alone": "compute_s",
        "transfer alone": "transfer_s",
        "ideal max(c, t)": "ideal_s",
    }
    _bars(ax, labels, {n: [c[k] * 1e3 for c in cases] for n, k in names.items()})
    ax.set_ylabel("ms per step (median)")
    ax.set_title("Decode-side load of a remote prefix, with the suffix's compute", fontsize=10)


def _lease(fig: Figure, data: Any) -> None:
    results = _get(data, "results")
    left, right = fig.subplots(1, 2, width_ratios=(3, 1))
    ops = {
        "renew (handles,\nbulk)": "renew",
        "renew (ids)": "renew_by_id",
        "expire,\nnone due": "expire_none_due",
        "expire,\nsome due": "expire_due",
    }
    series = {
        "kvframe LeaseTable": [results[k]["kvframe_s"] for k in ops.values()],
        "naive dict scan": [results[k]["naive_s"] for k in ops.values()],
    }
    _bars(left, list(ops), series)
    left.set_yscale("log")
    left.set_ylabel("seconds per call (median, log)")
    params = _get(data, "params")
    left.set_title(
        f"{params['leases']:,} live leases; {params['renew']:,} renewed, "
        f"{params['expire']:,} expired",
        fontsize=10,
    )
    for i, key in enumerate(ops.values()):
        left.annotate(
            _ratio(results[key]["ratio"]),
            (i, results[key]["naive_s"]),
            ha="center",
            va="bottom",
            fontsize=7,
        )
    hb = _get(data, "heartbeat")
    _bars(
        right,
        ["bytes per lease\nin a heartbeat"],
        {
            "kvframe (handle)": [hb["bytes_per_id"]],
            f"msgpack id ({hb['id_length']} B)": [hb["msgpack_bytes_per_id"]],
        },
    )
    right.set_title("Heartbeat size", fontsize=10)


def _codec(fig: Figure, data: Any) -> None:
    results = _get(data, "results")
    axes = fig.subplots(1, 2)
    params = _get(data, "params")
    titles = {"empty_step": "empty step", "loads_step": f"{params['loads']} loads"}
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        r = results[key]
        _bars(
            ax,
            ["median", "p90"],
            {
                "kvframe codec": [r["kvframe_median_s"] * 1e6, r["kvframe_p90_s"] * 1e6],
                "plain msgspec": [r["msgspec_median_s"] * 1e6, r["msgspec_p90_s"] * 1e6],
            },
        )
        ax.axhline(r["bar_s"] * 1e6, color="#c62828", ls="--", lw=1)
        ax.annotate(
            f"bar {_seconds(r['bar_s'])}",
            (1.45, r["bar_s"] * 1e6),
            color="#c62828",
            ha="right",
            va="bottom",
            fontsize=7,
        )
        ax.set_ylabel("µs per encode + decode")
        ax.set_title(
            f"{title}: {r['ratio_median']:.2f}× msgspec (bar {r['bar_ratio']:.3g}×)", fontsize=10
        )


def _offload(fig: Figure, data: Any) -> None:
    results = _get(data, "results")
    left, mid, right = fig.subplots(1, 3, width_ratios=(4, 2, 1.3))
    comps = _get(results, "comparisons")
    labels = [f"{name}\nvs {c['reference']}" for name, c in comps.items()]
    _bars(
        left,
        labels,
        {
            "kvframe tier": [c["gbps"] for c in comps.values()],
            "reference": [c["ref_gbps"] for c in comps.values()],
        },
    )
    left.set_ylabel("GB/s (median)")
    left.set_title("Each tier beside its reference", fontsize=10)
    ratios = [c["ratio"] for c in comps.values()]
    mid.bar(range(len(comps)), ratios, 0.6, color=_KVFRAME)
    for i, c in enumerate(comps.values()):
        if c.get("bar") is not None:
            mid.plot([i - 0.4, i + 0.4], [c["bar"]] * 2, color="#c62828", ls="--", lw=1)
    mid.set_xticks(range(len(comps)), list(comps), fontsize=7, rotation=30, ha="right")
    mid.axhline(1.0, color="k", lw=0.5)
    mid.set_title("tier / reference (dashed: bar)", fontsize=10)
    mid.grid(axis="y", alpha=0.3)
    hits = _get(results, "hit_rates")
    right.bar(list(hits), [h * 100 for h in hits.values()], 0.6, color=[_REFERENCE, _KVFRAME])
    right.set_ylabel("% of prompt blocks from CPU")
    right.set_title("Hit rate", fontsize=10)


_DRAW: dict[str, tuple[Callable[[Figure, Any], None], str, tuple[float, float]]] = {
    "transfer": (_transfer, "kvframe bench transfer: P→D READs and post cost", (11, 4.2)),
    "pipeline": (_pipeline, "kvframe bench pipeline: loading layer by layer", (9, 4)),
    "lease": (_lease, "kvframe bench lease: the lease table against a naive dict", (10, 4)),
    "codec": (_codec, "kvframe bench codec: per-step metadata, kvframe against msgspec", (9, 3.8)),
    "offload": (_offload, "kvframe bench offload: CPU and disk tiers", (12, 4)),
}


def _footer(name: str, data: Any, run: Any) -> str:
    params = data.get("params") or data.get("config") or data.get("model") or {}
    shown = ", ".join(
        f"{k}={v}" for k, v in params.items() if not isinstance(v, dict | list) and k != "dir"
    )
    quick = " --quick" if data.get("quick") or params.get("quick") else ""
    text = f"From one run of `kvframe bench {name}{quick}`"
    if isinstance(run, dict) and run.get("date"):
        load = run.get("loadavg")
        text += f", {run['date']}, {run.get('cpus', '?')} CPUs"
        if load is not None:
            text += f", load average {load[0]:.1f} → {load[1]:.1f}"
    text += f" ({shown})." if shown else "."
    if isinstance(run, dict) and max(run.get("loadavg") or [0]) >= (run.get("cpus") or 1) / 2:
        text += (
            "\nThe machine was busy with other work: compare the bars, not the absolute figures."
        )
    if quick:
        text += "\nSmall sizes (--quick): the figure shows the shape of the results only."
    return text


def data_digest(data: Any, run: Any = None) -> str:
    """sha256 of a benchmark's JSON ``data`` and its ``runs.json`` entry ``run`` (canonical
    JSON): each figure carries it in its description, so a test can tell that a committed
    figure was drawn from the committed data."""
    blob = json.dumps([data, run], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def draw(name: str, data: Any, out: Path, run: Any = None) -> Path:
    """Draw benchmark ``name``'s figure from its JSON ``data`` into ``out/NAME.svg``.

    ``run`` is its ``runs.json`` entry (command, date, load average), shown in the footer.

    :raises PlotError: ``data`` is not that benchmark's JSON (the message says which key).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(data, dict) or data.get("benchmark") != name:
        raise PlotError(f"it is not the JSON of `kvframe bench {name} --json`")
    func, title, size = _DRAW[name]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name, "font.size": 9}):
        fig = plt.figure(figsize=size, layout="constrained")
        try:
            try:
                func(fig, data)
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise PlotError(f"unexpected shape ({type(exc).__name__}: {exc})") from exc
            fig.suptitle(title, fontsize=11)
            fig.text(0.5, -0.02, _footer(name, data, run), ha="center", va="top", fontsize=7)
            path = out / f"{name}.svg"
            meta = {"Date": None, "Description": f"data sha256 {data_digest(data, run)}"}
            fig.savefig(path, format="svg", bbox_inches="tight", metadata=meta)
        finally:
            plt.close(fig)
    return path


def run_benchmarks(data_dir: Path, *, quick: bool) -> list[str]:
    """Run every benchmark of :data:`FIGURES` and save its JSON and ``runs.json`` in
    ``data_dir``; returns the names of those that failed (their old data stays)."""
    exe = Path(sys.executable).with_name("kvframe")
    kvframe = str(exe) if exe.exists() else shutil.which("kvframe") or "kvframe"
    runs_path = data_dir / "runs.json"
    runs: dict[str, Any] = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    failed = []
    for name, (full, small) in FIGURES.items():
        cmd = ["bench", name, "--json", *(small if quick else full)]
        print(f"plots: kvframe {' '.join(cmd)}", file=sys.stderr, flush=True)
        before = os.getloadavg()[0]
        proc = subprocess.run([kvframe, *cmd], stdout=subprocess.PIPE, text=True, check=False)
        try:
            report = json.loads(proc.stdout) if proc.returncode == 0 else None
        except json.JSONDecodeError:
            report = None
        if report is None:
            print(
                f"plots: kvframe bench {name} failed (exit {proc.returncode}); its old data stays",
                file=sys.stderr,
            )
            failed.append(name)
            continue
        (data_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        runs[name] = {
            "command": "kvframe " + " ".join(cmd),
            "date": time.strftime("%Y-%m-%d"),
            "loadavg": [round(before, 2), round(os.getloadavg()[0], 2)],
            "cpus": os.cpu_count(),
        }
        runs_path.write_text(json.dumps(runs, indent=2) + "\n")
    return failed


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring); returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m kvframe.bench.plots", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--data", type=Path, default=_DATA, help="the benchmarks' JSON (%(default)s)")
    ap.add_argument("--out", type=Path, default=_OUT, help="where the SVGs go (%(default)s)")
    ap.add_argument("--run", action="store_true", help="run the benchmarks first (minutes)")
    ap.add_argument("--quick", action="store_true", help="with --run: small sizes, shape only")
    args = ap.parse_args(argv)
    if args.quick and not args.run:
        ap.error("--quick only goes with --run")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            "plots: matplotlib is not installed: pip install matplotlib (or pip install -e "
            "'.[dev]')",
            file=sys.stderr,
        )
        return 2
    failed: list[str] = []
    if args.run:
        args.data.mkdir(parents=True, exist_ok=True)
        failed = run_benchmarks(args.data, quick=args.quick)
    found = [n for n in FIGURES if (args.data / f"{n}.json").is_file()]
    if not found:
        names = ", ".join(f"{n}.json" for n in FIGURES)
        print(
            f"plots: nothing to draw in {args.data}: it has none of {names} (write them with "
            "`kvframe bench NAME --json > DIR/NAME.json`, or pass --run)",
            file=sys.stderr,
        )
        return 2
    runs_path = args.data / "runs.json"
    try:
        runs = json.loads(runs_path.read_text()) if runs_path.is_file() else {}
    except json.JSONDecodeError as exc:
        print(f"plots: {runs_path} is not JSON ({exc})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name in found:
        path = args.data / f"{name}.json"
        try:
            data = json.loads(path.read_text())
            written = draw(name, data, args.out, runs.get(name))
        except json.JSONDecodeError as exc:
            print(f"plots: {path} is not JSON ({exc})", file=sys.stderr)
            return 2
        except PlotError as exc:
            print(f"plots: cannot draw {path}: {exc}", file=sys.stderr)
            return 2
        print(f"plots: {written}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
