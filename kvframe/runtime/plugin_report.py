"""``kvframe plugins``: what is installed, what each plugin registered, what failed.

The report is built once as plain data (:func:`report`) and printed either as text or as JSON
(``--json``), so both views always say the same thing. The command exits 1 when a plugin failed
to load or a name is ambiguous, so it doubles as a health check in deployment scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import IO, Any

from kvframe.errors import ConfigError
from kvframe.runtime.plugins import Kind, PluginHost, PluginStatus
from kvframe.spi.transport import TransportCapabilities

__all__ = ["add_arguments", "format_text", "report", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``plugins`` subcommand's options to ``parser``."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _capabilities(caps: TransportCapabilities) -> dict[str, Any]:
    return {
        "memory_kinds": sorted(k.value for k in caps.memory_kinds),
        "read": caps.read,
        "write": caps.write,
        "notifications": caps.notifications,
        "max_notification_bytes": caps.max_notification_bytes,
        "cross_process": caps.cross_process,
        "ordered_notifications": caps.ordered_notifications,
    }


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{name}"


def report(host: PluginHost) -> dict[str, Any]:
    """The report as JSON-ready data. Reads the host only; loads nothing.

    Keys: ``autoload`` (bool), ``blocked`` and ``unmatched_blocks`` (lists of names),
    ``plugins`` (name, source, status, distribution, version, target, what it registered,
    error), ``transports`` (name, plugin, distribution, version, capabilities),
    ``connectors``, ``offload_tiers``, ``eviction_policies`` and ``discovery_backends``
    (name, plugin, distribution, version, object), and ``errors`` (one message per problem).
    An ambiguous name is listed once per plugin that registered it, with ``"conflict": true``.
    """
    plugins = []
    for p in host.plugins():
        plugins.append(
            {
                "name": p.name,
                "source": p.source.value,
                "status": p.status.value,
                "distribution": p.distribution,
                "version": p.version,
                "target": p.target,
                "transports": list(p.transports),
                "connectors": list(p.connectors),
                "offload_tiers": list(p.offload_tiers),
                "eviction_policies": list(p.eviction_policies),
                "discovery_backends": list(p.discovery_backends),
                "error": str(p.error) if p.error is not None else None,
            }
        )
    by_kind: dict[Kind, list[dict[str, Any]]] = {k: [] for k in Kind}
    for kind in Kind:
        for reg in host.registrations(kind):
            row: dict[str, Any] = {
                "name": reg.name,
                "plugin": reg.plugin,
                "distribution": reg.distribution,
                "version": reg.version,
                "conflict": reg.ambiguous,
            }
            if reg.capabilities is not None:
                row["capabilities"] = _capabilities(reg.capabilities)
            else:
                row["object"] = _qualname(reg.obj)
            by_kind[kind].append(row)
    return {
        "autoload": host.autoload,
        "blocked": sorted(host.blocked),
        "unmatched_blocks": list(host.unmatched_blocks()),
        "plugins": plugins,
        "transports": by_kind[Kind.TRANSPORT],
        "connectors": by_kind[Kind.CONNECTOR],
        "offload_tiers": by_kind[Kind.OFFLOAD_TIER],
        "eviction_policies": by_kind[Kind.EVICTION_POLICY],
        "discovery_backends": by_kind[Kind.DISCOVERY],
        "errors": [str(e) for e in host.errors()],
    }


def _caps_text(c: dict[str, Any]) -> str:
    ops = "/".join(op for op in ("read", "write") if c[op]) or "no transfers"
    notif = (
        f"notifications up to {c['max_notification_bytes']} B"
        + ("" if c["ordered_notifications"] else " (unordered)")
        if c["notifications"]
        else "no notifications"
    )
    where = "cross-process" if c["cross_process"] else "in-process only"
    return f"memory {','.join(c['memory_kinds'])}; {ops}; {notif}; {where}"


def format_text(data: dict[str, Any]) -> str:
    """The report from :func:`report` as human-readable text."""
    out: list[str] = []
    autoload = "on" if data["autoload"] else "off (KVFRAME_DISABLE_PLUGIN_AUTOLOAD)"
    out.append(f"entry-point autoload: {autoload}")
    if data["blocked"]:
        out.append(f"blocked (KVFRAME_BLOCK_PLUGINS): {', '.join(data['blocked'])}")
    if data["unmatched_blocks"]:
        out.append(f"  matched no plugin: {', '.join(data['unmatched_blocks'])}")
    out.append("")
    out.append("plugins:")
    if not data["plugins"]:
        out.append("  (none)")
    for p in data["plugins"]:
        dist = f"{p['distribution']} {p['version']}" if p["distribution"] else "-"
        provides = [
            f"{label}: {', '.join(p[key])}"
            for key, label in (
                ("transports", "transports"),
                ("connectors", "connectors"),
                ("offload_tiers", "offload tiers"),
                ("eviction_policies", "eviction policies"),
                ("discovery_backends", "discovery backends"),
            )
            if p[key]
        ]
        out.append(f"  {p['name']}  [{p['status']}, {p['source']}]  {dist}  {p['target'] or ''}")
        out.extend(f"      {line}" for line in provides)
    sections: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
        ("transports", "transports", lambda r: _caps_text(r["capabilities"])),
        ("connectors", "connectors", lambda r: str(r["object"])),
        ("offload_tiers", "offload tiers", lambda r: str(r["object"])),
        ("eviction_policies", "eviction policies", lambda r: str(r["object"])),
        ("discovery_backends", "discovery backends", lambda r: str(r["object"])),
    ]
    for key, title, detail in sections:
        out.append("")
        out.append(f"{title}:")
        if not data[key]:
            out.append("  (none)")
        for r in data[key]:
            flag = "  AMBIGUOUS" if r["conflict"] else ""
            out.append(f"  {r['name']}  (from {r['plugin']}){flag}")
            out.append(f"      {detail(r)}")
    out.append("")
    if data["errors"]:
        out.append(f"errors ({len(data['errors'])}):")
        out.extend(f"  - {e}" for e in data["errors"])
    else:
        out.append("errors: none")
    return "\n".join(out) + "\n"


def run(
    args: argparse.Namespace, *, host: PluginHost | None = None, out: IO[str] | None = None
) -> int:
    """Run ``kvframe plugins``: load plugins (unless ``host`` is given and loaded) and print
    the report to ``out`` (default stdout).

    :returns: 0; 1 when a plugin failed to load or a name is ambiguous; 2 when an environment
        switch has a value the host does not understand (the message goes to stderr).
    """
    stream = out if out is not None else sys.stdout
    if host is None:
        try:
            host = PluginHost()
        except ConfigError as exc:
            print(f"kvframe plugins: {exc}", file=sys.stderr)
            return 2
    host.load()
    data = report(host)
    if args.json:
        stream.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        stream.write(format_text(data))
    failed = any(p.status is PluginStatus.FAILED for p in host.plugins())
    return 1 if failed or data["errors"] else 0
