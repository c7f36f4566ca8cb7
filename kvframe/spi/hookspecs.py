"""Every hook a kvframe plugin can implement, in one place.

A plugin is a module (or any object) with functions marked :data:`hookimpl` whose names are hook
names below. kvframe finds third-party plugins through the ``kvframe`` entry-point group::

    # the plugin distribution's pyproject.toml
    [project.entry-points.kvframe]
    fastwire = "kvframe_fastwire.plugin"

    # kvframe_fastwire/plugin.py
    from kvframe.spi.hookspecs import hookimpl

    @hookimpl
    def kvframe_register_transports(register):
        register("fastwire", FastWireTransport.create, capabilities=CAPS)

Every hook here is a *registration* hook: it receives a ``register`` callback and calls it once
per thing it provides. The plugin host (:class:`kvframe.runtime.plugins.PluginHost`) calls each
plugin's implementations exactly once, right after it loads that plugin, with a callback that
knows which plugin (and distribution) is registering, so clashes and bad arguments are reported
against the right distribution. A hook's return value is ignored.

The reference page of the documentation is generated from this module by
:func:`hook_reference`, so the docstrings below *are* the reference.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pluggy

from kvframe.spi.transport import TransportCapabilities, TransportFactory

if TYPE_CHECKING:
    from kvframe.spi.connector import KVConnector
    from kvframe.spi.discovery import DiscoveryFactory
    from kvframe.spi.offload import EvictionPolicyFactory, OffloadTierFactory

__all__ = [
    "PROJECT_NAME",
    "ConnectorRegistrar",
    "DiscoveryRegistrar",
    "EvictionPolicyRegistrar",
    "OffloadTierRegistrar",
    "TransportRegistrar",
    "hook_reference",
    "hookimpl",
    "hookspec",
    "hookspec_names",
    "hookspec_since",
    "kvframe_register_connectors",
    "kvframe_register_discovery_backends",
    "kvframe_register_eviction_policies",
    "kvframe_register_offload_tiers",
    "kvframe_register_transports",
]

#: The pluggy project name, which is also the entry-point group plugins are found in.
PROJECT_NAME = "kvframe"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a hook specification. Used only in this module."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementation: ``@hookimpl`` above ``def kvframe_register_...``."""

_F = TypeVar("_F", bound=Callable[..., Any])

#: hook name -> kvframe version that introduced it (filled by :func:`_spec`).
_SINCE: dict[str, str] = {}


def _spec(*, since: str) -> Callable[[_F], _F]:
    """Mark a hookspec and record the version it appeared in (rendered in the reference)."""

    def mark(fn: _F) -> _F:
        _SINCE[fn.__name__] = since
        return hookspec(fn)

    return mark


# -- the registration callbacks ------------------------------------------------------------


class TransportRegistrar(Protocol):
    """The ``register`` callback passed to :func:`kvframe_register_transports`."""

    def __call__(
        self, name: str, factory: TransportFactory, *, capabilities: TransportCapabilities
    ) -> None:
        """Register a transport.

        Arguments:
            name: what users write in their configuration (``"transport": "nixl"``). Letters,
                digits, ``.``, ``_`` and ``-``, starting with a letter or digit, at most 64
                characters; case matters.
            factory: called as ``factory(TransportParams(...))`` each time a connector needs a
                transport; returns a new :class:`~kvframe.spi.transport.Transport`. It is not
                called at registration, so registering costs nothing when the transport is
                never used.
            capabilities: what the transport supports (memory kinds, read/write,
                notifications and their size limit, cross-process). Shown by
                ``kvframe plugins`` and checked by connectors before they rely on a feature.

        Raises:
            PluginError: a bad name, a factory that is not callable or capabilities that are
                not a :class:`~kvframe.spi.transport.TransportCapabilities` (the plugin's
                registrations are all withdrawn and the error is reported against it).
        """


class ConnectorRegistrar(Protocol):
    """The ``register`` callback passed to :func:`kvframe_register_connectors`."""

    def __call__(self, name: str, connector: type[KVConnector]) -> None:
        """Register a connector class.

        Arguments:
            name: the connector's configuration name (same rules as transport names).
            connector: a subclass of :class:`kvframe.spi.connector.KVConnector` (the class,
                not an instance); the engine adapter builds its scheduler and worker sides.

        Raises:
            PluginError: a bad name or something that is not a ``KVConnector`` subclass.
        """


class OffloadTierRegistrar(Protocol):
    """The ``register`` callback passed to :func:`kvframe_register_offload_tiers`."""

    def __call__(self, name: str, factory: OffloadTierFactory) -> None:
        """Register an offload-tier factory.

        Arguments:
            name: the tier's configuration name (same rules as transport names), what users
                write as ``"tier"`` in the offloading connector's ``tiers`` list.
            factory: called as ``factory(TierConfig(...))`` (see :mod:`kvframe.spi.offload`)
                in the scheduler process and in every worker; returns a new
                :class:`~kvframe.spi.offload.OffloadTier` (a
                :class:`~kvframe.spi.offload.MemoryTier` to be usable as the first tier). It
                must be cheap (memory is reserved in ``open()``) and raise
                :class:`~kvframe.errors.ConfigError` naming the option for bad options. A
                class is a fine factory. The host checks only that it is callable; the
                connector refuses a factory that returns something else, naming the tier.

        Raises:
            PluginError: a bad name or a factory that is not callable.
        """


class EvictionPolicyRegistrar(Protocol):
    """The ``register`` callback passed to :func:`kvframe_register_eviction_policies`."""

    def __call__(self, name: str, factory: EvictionPolicyFactory) -> None:
        """Register an eviction-policy factory.

        Arguments:
            name: the policy's configuration name (same rules as transport names), what users
                write as ``eviction_policy``.
            factory: called as ``factory(PolicyConfig(...))`` once per tier; returns a new
                :class:`~kvframe.spi.offload.EvictionPolicy`. A class is a fine factory. The
                host checks only that it is callable; the connector refuses a factory that
                returns something else.

        Raises:
            PluginError: a bad name or a factory that is not callable.
        """


class DiscoveryRegistrar(Protocol):
    """The ``register`` callback passed to :func:`kvframe_register_discovery_backends`."""

    def __call__(self, name: str, factory: DiscoveryFactory) -> None:
        """Register a discovery backend.

        Arguments:
            name: what users write as the backend (``"etcd"``; same rules as transport names).
            factory: called as ``factory(DiscoveryParams(options=...))`` each time someone
                needs the backend; returns a new :class:`~kvframe.spi.discovery.Discovery`.
                It must not connect to anything before it is called, so an installed but
                unused backend costs nothing beyond its import; it raises
                :class:`~kvframe.errors.ConfigError` naming the option for bad options.

        Raises:
            PluginError: a bad name or a factory that is not callable.
        """


# -- the hooks -----------------------------------------------------------------------------


@_spec(since="0.1.0")
def kvframe_register_transports(register: TransportRegistrar) -> None:
    """Register the transports this plugin provides.

    A transport moves KV blocks between engines (see :mod:`kvframe.spi.transport`). Register a
    *factory*, not an instance: nothing is created until a connector asks for the transport by
    name, so an installed but unused transport costs nothing beyond its import.

    Arguments:
        register: a [`TransportRegistrar`](#transportregistrar); call it as
            `register(name, factory, *, capabilities)` once per transport.

    Returns:
        Nothing; the return value is ignored.

    When it is called:
        Once per plugin, right after the host loads it (built-ins first, then entry points,
        then plugins registered by code). Every plugin's implementation is called: the hook is
        neither `firstresult` nor historic in pluggy's sense, but the host calls it for a
        plugin registered late too, so a plugin never misses it.

    Errors:
        Registering a name another plugin already registered makes the name ambiguous: asking
        for it raises `PluginConflictError` naming both distributions, until one is blocked
        with `KVFRAME_BLOCK_PLUGINS`. An exception raised here, or a `register` call with
        wrong arguments, withdraws everything this plugin registered and is reported as a
        `PluginError` naming the distribution and entry point.

    Example:
        ```python
        from kvframe.spi.hookspecs import hookimpl
        from kvframe.spi.transport import MemoryKind, TransportCapabilities

        CAPS = TransportCapabilities(
            memory_kinds={MemoryKind.HOST}, read=True, write=True,
            notifications=True, max_notification_bytes=4096,
        )

        @hookimpl
        def kvframe_register_transports(register):
            register("fastwire", FastWireTransport.create, capabilities=CAPS)
        ```
    """


@_spec(since="0.1.0")
def kvframe_register_connectors(register: ConnectorRegistrar) -> None:
    """Register the connector classes this plugin provides.

    A connector is what an engine adapter plugs into the engine: it decides which KV blocks to
    save and load and drives a transport to move them.

    Arguments:
        register: a [`ConnectorRegistrar`](#connectorregistrar); call it as
            `register(name, connector_class)` once per connector.

    Returns:
        Nothing; the return value is ignored.

    When it is called:
        Once per plugin, right after the host loads it, like every registration hook.

    Errors:
        Same as `kvframe_register_transports`: a clash makes the name ambiguous
        (`PluginConflictError` when asked for), a failure withdraws the plugin's
        registrations and is reported as a `PluginError`.

    Example:
        ```python
        from kvframe.spi.connector import KVConnector
        from kvframe.spi.hookspecs import hookimpl

        class MyConnector(KVConnector):
            ...

        @hookimpl
        def kvframe_register_connectors(register):
            register("mine", MyConnector)
        ```
    """


@_spec(since="0.1.0")
def kvframe_register_offload_tiers(register: OffloadTierRegistrar) -> None:
    """Register offload-tier factories (places to keep KV blocks: host memory, disk, ...).

    The tier contract is :class:`kvframe.spi.offload.OffloadTier` (``docs/offloading.md`` has
    a complete example); the factory receives a :class:`~kvframe.spi.offload.TierConfig` and
    returns the tier. kvframe's own ``cpu`` and ``disk`` tiers are registered through this hook.

    Arguments:
        register: an [`OffloadTierRegistrar`](#offloadtierregistrar); call it as
            `register(name, factory)` once per tier.

    Returns:
        Nothing; the return value is ignored.

    When it is called:
        Once per plugin, right after the host loads it, like every registration hook.

    Errors:
        Same as `kvframe_register_transports`.

    Example:
        ```python
        from kvframe.spi.hookspecs import hookimpl

        @hookimpl
        def kvframe_register_offload_tiers(register):
            register("local-disk", LocalDiskTier)  # LocalDiskTier(TierConfig) -> OffloadTier
        ```
    """


@_spec(since="0.1.0")
def kvframe_register_eviction_policies(register: EvictionPolicyRegistrar) -> None:
    """Register eviction-policy factories (which blocks an offload tier drops when full).

    The policy contract is :class:`kvframe.spi.offload.EvictionPolicy`; the factory receives a
    :class:`~kvframe.spi.offload.PolicyConfig` and returns the policy. kvframe's own ``lru``
    and ``arc`` are registered through this hook.

    Arguments:
        register: an [`EvictionPolicyRegistrar`](#evictionpolicyregistrar); call it as
            `register(name, factory)` once per policy.

    Returns:
        Nothing; the return value is ignored.

    When it is called:
        Once per plugin, right after the host loads it, like every registration hook.

    Errors:
        Same as `kvframe_register_transports`.

    Example:
        ```python
        from kvframe.spi.hookspecs import hookimpl

        @hookimpl
        def kvframe_register_eviction_policies(register):
            register("fifo", FIFOPolicy)  # FIFOPolicy(PolicyConfig) -> EvictionPolicy
        ```
    """


@_spec(since="0.2.0")
def kvframe_register_discovery_backends(register: DiscoveryRegistrar) -> None:
    """Register discovery backends (where a fleet's engines register and are watched).

    The backend contract is :class:`kvframe.spi.discovery.Discovery`: register an
    :class:`~kvframe.core.fleet.EngineRecord` and keep it alive, watch the fleet (added,
    changed and vanished engines, decided by :class:`~kvframe.core.fleet.FleetView`), withdraw.
    kvframe's own ``mem`` and ``file`` backends are registered through this hook, and the
    ``kvframe-etcd`` distribution registers ``etcd``.

    Arguments:
        register: a [`DiscoveryRegistrar`](#discoveryregistrar); call it as
            `register(name, factory)` once per backend.

    Returns:
        Nothing; the return value is ignored.

    When it is called:
        Once per plugin, right after the host loads it, like every registration hook.

    Errors:
        Same as `kvframe_register_transports`.

    Example:
        ```python
        from kvframe.spi.hookspecs import hookimpl

        @hookimpl
        def kvframe_register_discovery_backends(register):
            register("consul", ConsulDiscovery.create)  # (DiscoveryParams) -> Discovery
        ```
    """


# -- introspection and the generated reference ---------------------------------------------

_HOOKS: tuple[Callable[..., Any], ...] = (
    kvframe_register_transports,
    kvframe_register_connectors,
    kvframe_register_offload_tiers,
    kvframe_register_eviction_policies,
    kvframe_register_discovery_backends,
)
_REGISTRARS: tuple[type[Any], ...] = (
    TransportRegistrar,
    ConnectorRegistrar,
    OffloadTierRegistrar,
    EvictionPolicyRegistrar,
    DiscoveryRegistrar,
)


def hookspec_names() -> tuple[str, ...]:
    """The names of every hook specification in this module, in declaration order."""
    return tuple(fn.__name__ for fn in _HOOKS)


def hookspec_since(name: str) -> str:
    """The kvframe version that introduced hook ``name``.

    Raises ``KeyError`` for a name that is not a hook specification.
    """
    return _SINCE[name]


def _spec_opts(fn: Callable[..., Any]) -> Mapping[str, Any]:
    opts: Mapping[str, Any] = getattr(fn, f"{PROJECT_NAME}_spec")
    return opts


def _signature(fn: Callable[..., Any], name: str) -> str:
    # Annotations are strings here (``from __future__ import annotations``); print them as
    # written instead of letting inspect quote them.
    parts: list[str] = []
    star_done = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        ann = "" if p.annotation is p.empty else f": {p.annotation}"
        parts.append(f"{p.name}{ann}")
    ret = inspect.signature(fn).return_annotation
    ret_text = "" if ret is inspect.Signature.empty else f" -> {ret}"
    return f"{name}({', '.join(parts)}){ret_text}"


def _markdown_sections(doc: str) -> str:
    """Turn a Google-style docstring body into markdown.

    Section titles (``Arguments:`` ...) become bold paragraphs and their indented bodies are
    dedented; ``name: text`` entries of argument-like sections become list items.
    """
    lines = textwrap.dedent(doc).strip("\n").splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        is_title = (
            line.endswith(":")
            and not line.startswith((" ", "\t"))
            and i + 1 < len(lines)
            and lines[i + 1].startswith("    ")
        )
        if not is_title:
            out.append(line)
            i += 1
            continue
        title = line[:-1]
        body: list[str] = []
        i += 1
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            body.append(lines[i])
            i += 1
        text = textwrap.dedent("\n".join(body)).strip("\n")
        out.append(f"**{title}**")
        out.append("")
        if title in ("Arguments", "Raises"):
            out.extend(_entries_as_list(text))
        else:
            out.extend(text.splitlines())
        out.append("")
    return "\n".join(out).strip() + "\n"


def _entries_as_list(text: str) -> list[str]:
    items: list[str] = []
    for line in text.splitlines():
        if line and not line.startswith(" ") and ":" in line:
            key, _, rest = line.partition(":")
            items.append(f"- `{key.strip()}`: {rest.strip()}")
        elif items:
            items[-1] += " " + line.strip()
    return items


def _rst_to_markdown(text: str) -> str:
    """Sphinx roles and double backticks (kept in docstrings for ``help()`` and mkdocstrings)
    rendered as markdown code spans; fenced code blocks are left alone."""
    text = _ROLE.sub(_role_text, text)
    return _DOUBLE_BACKTICK.sub("`", text)


_ROLE = re.compile(r":(class|func|meth|mod|data|attr|exc):`(~?)([\w.]+)`")
_DOUBLE_BACKTICK = re.compile(r"(?<!`)``(?!`)")


def _role_text(match: re.Match[str]) -> str:
    role, short, target = match.groups()
    shown = target.rsplit(".", 1)[-1] if short or role != "mod" else target
    return f"`{shown}`"


def hook_reference() -> str:
    """The hook reference as markdown, generated from this module (used by ``docs/plugins.md``).

    One ``### `name` `` section per hook (signature, since-version, call style, the docstring)
    followed by one section per registration callback. Never raises for the hooks defined
    here; a hookspec without a docstring raises ``ValueError`` so the docs build fails loudly.
    """
    parts: list[str] = []
    for fn in _HOOKS:
        name = fn.__name__
        if not fn.__doc__:
            raise ValueError(f"hookspec {name} has no docstring; document it before release")
        opts = _spec_opts(fn)
        style = []
        style.append(
            "firstresult (the first non-`None` result wins)"
            if opts.get("firstresult")
            else "every implementation is called"
        )
        style.append("historic" if opts.get("historic") else "not historic")
        summary, _, body = inspect.cleandoc(fn.__doc__).partition("\n")
        parts.append(f"### `{name}`\n")
        parts.append(f"```python\ndef {_signature(fn, name)}\n```\n")
        parts.append(f"*Since kvframe {_SINCE[name]}. Call style: {', '.join(style)}.*\n")
        parts.append(_rst_to_markdown(summary) + "\n")
        parts.append(_rst_to_markdown(_markdown_sections(body)))
    parts.append("## Registration callbacks\n")
    parts.append(
        "Each hook receives one of these as `register`. They validate their arguments at once, "
        "so a mistake is reported against the plugin that made it.\n"
    )
    for proto in _REGISTRARS:
        call = proto.__call__
        parts.append(f"### `{proto.__name__}`\n")
        parts.append(f"```python\ndef {_signature(call, 'register')}\n```\n")
        summary, _, body = inspect.cleandoc(call.__doc__ or "").partition("\n")
        parts.append(_rst_to_markdown(summary) + "\n")
        parts.append(_rst_to_markdown(_markdown_sections(body)))
    return "\n".join(parts)
