"""Statistics for operators: kvframe :class:`~kvframe.protocol.messages.Stats` in the
Prometheus text exposition format.

Counter names may carry a per-remote-engine suffix (``bytes_read.P0``): it becomes a
``remote_engine`` label. Names are sanitised to ``[a-zA-Z0-9_]``; counters get ``_total``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kvframe.protocol.messages import Stats

__all__ = ["StatsAccumulator", "to_prometheus"]

_BAD = re.compile(r"[^a-zA-Z0-9_]")


#: A MultiConnector child's prefix: ``<index>.<connector name>.`` (nested children repeat it).
_CHILD = re.compile(r"^(\d+\.[A-Za-z_][\w-]*)\.(.+)$")


def _split(name: str) -> tuple[str, str | None, str | None]:
    """``[child prefix.]counter[.remote engine]`` → (metric base, child, remote engine)."""
    child: str | None = None
    while (m := _CHILD.match(name)) is not None:
        child = m.group(1) if child is None else f"{child}/{m.group(1)}"
        name = m.group(2)
    base, dot, engine = name.partition(".")
    return _BAD.sub("_", base), child, (engine if dot else None)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class StatsAccumulator:
    """Adds up per-step counters and keeps the latest gauges, for a scrape endpoint."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}

    def add(self, stats: Stats) -> None:
        """Fold one step's stats in."""
        for k, v in stats.counters.items():
            self.counters[k] = self.counters.get(k, 0) + v
        self.gauges.update(stats.gauges)

    def snapshot(self) -> Stats:
        """Everything so far as one :class:`Stats`."""
        return Stats(counters=dict(self.counters), gauges=dict(self.gauges))


def to_prometheus(
    stats: Stats, *, prefix: str = "kvframe_", labels: Mapping[str, str] | None = None
) -> str:
    """Render ``stats`` (usually a :meth:`StatsAccumulator.snapshot`) as Prometheus text.

    ``labels`` are added to every sample (for example ``{"engine_id": "P0"}``). A name
    ``counter.<engine>`` becomes ``counter{remote_engine="<engine>"}``; a MultiConnector
    child's ``<index>.<connector>.counter`` becomes ``counter{child="<index>.<connector>"}``.
    """
    base_labels = dict(labels or {})
    lines: list[str] = []
    for kind, values in (("counter", stats.counters), ("gauge", stats.gauges)):
        families: dict[str, list[tuple[str | None, str | None, float]]] = {}
        for name, value in values.items():
            base, child, engine = _split(name)
            families.setdefault(base, []).append((child, engine, value))
        for base in sorted(families):
            metric = f"{prefix}{base}" + ("_total" if kind == "counter" else "")
            lines.append(f"# TYPE {metric} {kind}")
            for child, engine, value in families[base]:
                lab = dict(base_labels)
                if child is not None:
                    lab["child"] = child
                if engine is not None:
                    lab["remote_engine"] = engine
                text = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(lab.items()))
                lines.append(f"{metric}{{{text}}} {value:g}" if text else f"{metric} {value:g}")
    return "\n".join(lines) + ("\n" if lines else "")
