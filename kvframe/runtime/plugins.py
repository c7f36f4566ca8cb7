"""The plugin host: finds plugins, calls their registration hooks, answers lookups by name.

Each runtime (an engine adapter, the ``kvframe`` command, a test) builds its own
:class:`PluginHost`; there is no module-global plugin manager, so two hosts never share
registrations. The hooks are specified in :mod:`kvframe.spi.hookspecs`.

Discovery, in order, when :meth:`PluginHost.load` runs:

1. **Built-ins** (:data:`BUILTIN_PLUGINS`: the in-process transport, the P/D, offloading and
   multi connectors, the offload tiers and eviction policies, the ``mem`` and ``file``
   discovery backends) are imported and registered by
   the host through the same hooks a third-party plugin implements. They load even when
   entry-point autoloading is off, so a kvframe without any installed plugin still works.
2. **Entry points** of the ``kvframe`` group, one plugin per entry point, unless autoloading is
   off (``KVFRAME_DISABLE_PLUGIN_AUTOLOAD=1``). An entry point naming a built-in module is
   ignored (the built-in is already registered; this keeps an older install's metadata from
   registering it twice).

Plugins registered by code (:meth:`PluginHost.register`) may come before or after
:meth:`~PluginHost.load`.

``KVFRAME_BLOCK_PLUGINS=a,b`` skips discovered plugins whose plugin (entry-point) name or
distribution name is listed; names compare case-insensitively with ``-``, ``_`` and ``.``
treated alike. Blocking ``kvframe`` blocks the built-ins.

**Failure policy: record discovered failures, raise explicit ones.** A discovered plugin that
fails to import, whose hook raises, or that calls ``register`` with bad arguments does not stop
:meth:`~PluginHost.load`: everything that plugin registered is withdrawn, the error (a
:class:`~kvframe.errors.PluginError` naming the distribution and entry point, chaining the
cause) is recorded, and the other plugins load normally. The error surfaces where someone
looks: :meth:`~PluginHost.plugins` and :meth:`~PluginHost.errors` list it, ``kvframe plugins``
prints it and exits 1, and a lookup of a name that is not found mentions it. A broken plugin
that nobody uses therefore cannot take an engine down; one that is needed cannot fail silently.
Callers that want fail-fast call ``load(strict=True)`` or :meth:`~PluginHost.check`.
:meth:`~PluginHost.register`, being explicit, raises at once and registers nothing.

Two plugins registering the same name make that name *ambiguous*: neither wins (an answer that
depends on installation order would be worse than none), and asking for it raises
:class:`~kvframe.errors.PluginConflictError` naming both distributions and how to block one.

A host is meant to be built and loaded at start-up from one thread; it is not thread-safe.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.metadata
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, Protocol

import attrs
import pluggy

from kvframe.errors import (
    ConfigError,
    KVFrameError,
    PluginConflictError,
    PluginError,
    PluginNotFoundError,
)
from kvframe.spi import hookspecs
from kvframe.spi.connector import KVConnector
from kvframe.spi.discovery import Discovery, DiscoveryParams
from kvframe.spi.transport import (
    Transport,
    TransportCapabilities,
    TransportFactory,
    TransportParams,
)

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "ENV_BLOCK_PLUGINS",
    "ENV_DISABLE_PLUGIN_AUTOLOAD",
    "NAME_RULE",
    "ComponentInfo",
    "ConnectorInfo",
    "DistributionLike",
    "EntryPointLike",
    "Kind",
    "PluginHost",
    "PluginInfo",
    "PluginSource",
    "PluginStatus",
    "Registration",
    "TransportInfo",
]

#: The entry-point group third-party plugins are found in.
ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
#: Set to ``1`` (or ``true``/``yes``/``on``) to stop loading entry-point plugins.
ENV_DISABLE_PLUGIN_AUTOLOAD = "KVFRAME_DISABLE_PLUGIN_AUTOLOAD"
#: Comma-separated plugin or distribution names not to load.
ENV_BLOCK_PLUGINS = "KVFRAME_BLOCK_PLUGINS"
#: Built-in plugins as (plugin name, module), registered by the host before entry points.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (
    ("inprocess", "kvframe.transports.inprocess"),
    ("pd", "kvframe.connectors.pd"),
    ("offload", "kvframe.connectors.offload"),
    ("multi", "kvframe.connectors.multi"),
    ("discovery", "kvframe.discovery"),
)
#: What a registered name must look like (it appears in configuration files and commands).
#: Case is kept and matters (``PDConnector`` follows vLLM's connector names); a lookup that
#: differs only in case is answered with a suggestion.
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


class Kind(enum.Enum):
    """What a plugin can register; the value is the word used in messages."""

    TRANSPORT = "transport"
    CONNECTOR = "connector"
    OFFLOAD_TIER = "offload tier"
    EVICTION_POLICY = "eviction policy"
    DISCOVERY = "discovery backend"

    @property
    def hook(self) -> str:
        """The registration hook for this kind."""
        return _HOOK_OF[self]

    @property
    def plural(self) -> str:
        """The plural used in messages ("eviction policies")."""
        return self.value[:-1] + "ies" if self.value.endswith("y") else self.value + "s"


_HOOK_OF = {
    Kind.TRANSPORT: "kvframe_register_transports",
    Kind.CONNECTOR: "kvframe_register_connectors",
    Kind.OFFLOAD_TIER: "kvframe_register_offload_tiers",
    Kind.EVICTION_POLICY: "kvframe_register_eviction_policies",
    Kind.DISCOVERY: "kvframe_register_discovery_backends",
}


class PluginSource(enum.Enum):
    """How the host found a plugin."""

    BUILTIN = "builtin"
    """Shipped with kvframe (:data:`BUILTIN_PLUGINS`)."""
    ENTRY_POINT = "entry-point"
    """An entry point of the ``kvframe`` group."""
    CODE = "code"
    """Registered by :meth:`PluginHost.register`."""


class PluginStatus(enum.Enum):
    """Whether a plugin is in use."""

    LOADED = "loaded"
    FAILED = "failed"
    """It could not be imported or registered; :attr:`PluginInfo.error` says why. Nothing it
    registered is visible."""
    BLOCKED = "blocked"
    """Named in ``KVFRAME_BLOCK_PLUGINS``; not imported."""


class DistributionLike(Protocol):
    """The part of :class:`importlib.metadata.Distribution` the host reads."""

    @property
    def name(self) -> str:
        """The distribution's name as installed (``kvframe-nixl``)."""
        ...

    @property
    def version(self) -> str:
        """The installed version."""
        ...


class EntryPointLike(Protocol):
    """The part of :class:`importlib.metadata.EntryPoint` the host reads (tests pass fakes)."""

    @property
    def name(self) -> str:
        """The entry point's name; it becomes the plugin's name."""
        ...

    @property
    def value(self) -> str:
        """What it points at: ``module`` or ``module:attribute``."""
        ...

    @property
    def dist(self) -> DistributionLike | None:
        """The distribution that declared it; ``None`` when unknown."""
        ...

    def load(self) -> Any:
        """Import and return the plugin object; may raise anything the import raises."""
        ...


@attrs.frozen(kw_only=True)
class TransportInfo:
    """A registered transport and who registered it."""

    name: str
    factory: TransportFactory
    capabilities: TransportCapabilities
    plugin: str
    """The registering plugin's name (its entry-point name for discovered plugins)."""
    distribution: str | None
    """The distribution that installed the plugin; ``None`` for plugins registered by code."""
    version: str | None
    """That distribution's version."""


@attrs.frozen(kw_only=True)
class ConnectorInfo:
    """A registered connector class and who registered it."""

    name: str
    connector: type[KVConnector]
    plugin: str
    distribution: str | None
    version: str | None


@attrs.frozen(kw_only=True)
class ComponentInfo:
    """A registered offload-tier or eviction-policy factory and who registered it."""

    kind: Kind
    name: str
    factory: Callable[..., Any]
    plugin: str
    distribution: str | None
    version: str | None


@attrs.frozen(kw_only=True)
class Registration:
    """One ``register`` call that the host accepted, for listings (``kvframe plugins``)."""

    kind: Kind
    name: str
    obj: Any
    """The factory (transports, tiers, policies) or the class (connectors)."""
    capabilities: TransportCapabilities | None
    """For transports; ``None`` for the other kinds."""
    plugin: str
    distribution: str | None
    version: str | None
    ambiguous: bool
    """Another plugin registered the same name, so lookups of it raise
    :class:`~kvframe.errors.PluginConflictError`."""


@attrs.frozen(kw_only=True)
class PluginInfo:
    """One plugin as the host sees it: where it came from, what it registered, whether it
    failed."""

    name: str
    source: PluginSource
    status: PluginStatus
    distribution: str | None
    version: str | None
    target: str | None
    """What was imported: the entry point's value (``module:attr``) or the built-in's module;
    ``None`` for plugins registered by code."""
    transports: tuple[str, ...] = ()
    connectors: tuple[str, ...] = ()
    offload_tiers: tuple[str, ...] = ()
    eviction_policies: tuple[str, ...] = ()
    discovery_backends: tuple[str, ...] = ()
    error: PluginError | None = None
    """Why the plugin failed (``status`` is ``FAILED``); the original exception is its
    ``__cause__``."""

    def describe(self) -> str:
        """A one-line description naming the plugin, its distribution and entry point."""
        return _describe(self.name, self.source, self.distribution, self.version, self.target)


def _describe(
    name: str,
    source: PluginSource,
    distribution: str | None,
    version: str | None,
    target: str | None,
) -> str:
    if source is PluginSource.CODE:
        return f"plugin {name!r} (registered by code)"
    dist = f"{distribution} {version}" if distribution else "unknown distribution"
    if source is PluginSource.BUILTIN:
        return f"built-in plugin {name!r} ({dist}, module {target})"
    return f"plugin {name!r} (distribution {dist}, entry point {name} = {target})"


@attrs.define(eq=False, kw_only=True)
class _Plugin:
    """The host's mutable record of one plugin."""

    name: str
    source: PluginSource
    distribution: str | None = None
    version: str | None = None
    target: str | None = None
    obj: Any = None
    status: PluginStatus = PluginStatus.LOADED
    error: PluginError | None = None
    names: dict[Kind, list[str]] = attrs.Factory(lambda: {k: [] for k in Kind})

    def describe(self) -> str:
        return _describe(self.name, self.source, self.distribution, self.version, self.target)

    def pluggy_name(self) -> str:
        return f"{self.distribution}:{self.name}" if self.distribution else self.name

    def block_hint(self) -> str:
        if self.source is PluginSource.CODE:
            return f"stop registering plugin {self.name!r}"
        return f"{ENV_BLOCK_PLUGINS}={self.name}"

    def info(self) -> PluginInfo:
        return PluginInfo(
            name=self.name,
            source=self.source,
            status=self.status,
            distribution=self.distribution,
            version=self.version,
            target=self.target,
            transports=tuple(self.names[Kind.TRANSPORT]),
            connectors=tuple(self.names[Kind.CONNECTOR]),
            offload_tiers=tuple(self.names[Kind.OFFLOAD_TIER]),
            eviction_policies=tuple(self.names[Kind.EVICTION_POLICY]),
            discovery_backends=tuple(self.names[Kind.DISCOVERY]),
            error=self.error,
        )


@attrs.frozen(kw_only=True)
class _Entry:
    kind: Kind
    name: str
    obj: Any
    capabilities: TransportCapabilities | None
    plugin: _Plugin


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _default_entry_points() -> Iterable[EntryPointLike]:
    # Looked up at call time so that tests can monkeypatch importlib.metadata.entry_points.
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _parse_autoload_env(env: Mapping[str, str]) -> bool:
    raw = env.get(ENV_DISABLE_PLUGIN_AUTOLOAD, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return False
    if value in _FALSE:
        return True
    raise ConfigError(
        f"{ENV_DISABLE_PLUGIN_AUTOLOAD}={raw!r} is not understood: set it to 1 to turn off "
        "loading plugins from entry points, or to 0 (or unset it) to keep loading them"
    )


def _parse_block(items: Iterable[str]) -> frozenset[str]:
    if isinstance(items, str):
        # A bare string is a comma-separated list, not an iterable of one-letter names.
        items = [items]
    out: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(
                f"blocked plugin names must be strings, got {item!r}; pass plugin or "
                "distribution names"
            )
        for part in item.split(","):
            if part.strip():
                out.add(part.strip())
    return frozenset(out)


class PluginHost:
    """Loads plugins and answers lookups: a typed facade over a pluggy ``PluginManager``.

    :param autoload: load entry-point plugins in :meth:`load`. ``None`` (the default) reads
        ``KVFRAME_DISABLE_PLUGIN_AUTOLOAD`` from ``env``; built-ins load either way.
    :param block: plugin or distribution names not to load. ``None`` reads the comma-separated
        ``KVFRAME_BLOCK_PLUGINS`` from ``env``; a given value replaces it. Items may contain
        commas, and a bare string is read as one comma-separated list.
    :param env: the environment to read the switches from; default ``os.environ``, read once,
        here. Pass ``{}`` to ignore the process environment.
    :param entry_points: a zero-argument callable returning the entry points to load; default
        ``importlib.metadata.entry_points(group="kvframe")``. Tests inject fakes here.
    :param builtins: (plugin name, module) pairs to treat as built-ins; default
        :data:`BUILTIN_PLUGINS`.
    :raises ConfigError: an environment switch has a value the host does not understand (the
        message names the variable and the accepted values). Nothing was created.

    Construction loads nothing; call :meth:`load`.
    """

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        block: Iterable[str] | None = None,
        env: Mapping[str, str] | None = None,
        entry_points: Callable[[], Iterable[EntryPointLike]] | None = None,
        builtins: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        environ: Mapping[str, str] = os.environ if env is None else env
        self._autoload = _parse_autoload_env(environ) if autoload is None else bool(autoload)
        self._block = _parse_block(
            environ.get(ENV_BLOCK_PLUGINS, "").split(",") if block is None else block
        )
        self._block_keys = {_normalize(b): b for b in self._block}
        self._matched_blocks: set[str] = set()
        self._entry_points = entry_points if entry_points is not None else _default_entry_points
        self._builtins = tuple(BUILTIN_PLUGINS if builtins is None else builtins)
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._plugins: list[_Plugin] = []
        self._host_errors: list[PluginError] = []
        self._registry: dict[Kind, dict[str, list[_Entry]]] = {k: {} for k in Kind}
        self._loaded = False

    # -- settings -------------------------------------------------------------------------
    @property
    def autoload(self) -> bool:
        """Whether :meth:`load` loads entry-point plugins."""
        return self._autoload

    @property
    def blocked(self) -> frozenset[str]:
        """The block list as given (plugin or distribution names)."""
        return self._block

    @property
    def loaded(self) -> bool:
        """Whether :meth:`load` has run."""
        return self._loaded

    def unmatched_blocks(self) -> tuple[str, ...]:
        """Block-list entries that matched no discovered plugin (likely typos), after
        :meth:`load`."""
        return tuple(sorted(b for b in self._block if _normalize(b) not in self._matched_blocks))

    # -- loading --------------------------------------------------------------------------
    def load(self, *, strict: bool = False) -> None:
        """Register the built-ins, then (unless autoload is off) every entry-point plugin.

        Idempotent: later calls do nothing but the ``strict`` check. A plugin that fails is
        recorded, not raised (see the module docstring), and the others still load.

        :param strict: after loading, raise if any plugin failed or any name is ambiguous
            (as :meth:`check` does). The host stays loaded and usable either way.
        :raises PluginError: only with ``strict=True``.
        """
        if not self._loaded:
            self._loaded = True
            for name, module in self._builtins:
                self._load_builtin(name, module)
            if self._autoload:
                self._load_entry_points()
        if strict:
            self.check()

    def _blocked(self, *names: str | None) -> bool:
        hit = False
        for n in names:
            if n is not None and _normalize(n) in self._block_keys:
                self._matched_blocks.add(_normalize(n))
                hit = True
        return hit

    def _load_builtin(self, name: str, module: str) -> None:
        import kvframe

        rec = _Plugin(
            name=name,
            source=PluginSource.BUILTIN,
            distribution="kvframe",
            version=kvframe.__version__,
            target=module,
        )
        self._plugins.append(rec)
        if self._blocked(name, "kvframe"):
            rec.status = PluginStatus.BLOCKED
            return
        try:
            obj = importlib.import_module(module)
        except Exception as exc:
            self._fail(rec, f"could not import {module}: {_first_line(exc)}", exc)
            return
        self._activate(rec, obj, explicit=False)

    def _load_entry_points(self) -> None:
        try:
            eps = list(self._entry_points())
        except Exception as exc:
            err = PluginError(
                f"could not list the {ENTRY_POINT_GROUP!r} entry points: {_first_line(exc)}; "
                "the installed distributions' metadata may be damaged (reinstall them)"
            )
            err.__cause__ = exc
            self._host_errors.append(err)
            return
        builtin_modules = {module for _, module in self._builtins}
        seen: set[tuple[str | None, str]] = set()
        for ep in eps:
            dist = ep.dist
            dist_name = dist.name if dist is not None else None
            key = (_normalize(dist_name) if dist_name else None, ep.name)
            if ep.value.partition(":")[0].strip() in builtin_modules or key in seen:
                continue  # a built-in's stale entry point, or the same distribution twice
            seen.add(key)
            rec = _Plugin(
                name=ep.name,
                source=PluginSource.ENTRY_POINT,
                distribution=dist_name,
                version=dist.version if dist is not None else None,
                target=ep.value,
            )
            self._plugins.append(rec)
            if self._blocked(ep.name, dist_name):
                rec.status = PluginStatus.BLOCKED
                continue
            try:
                obj = ep.load()
            except Exception as exc:
                self._fail(rec, f"its entry point failed to import: {_first_line(exc)}", exc)
                continue
            if self._pm.is_registered(obj):
                # Two entry points naming one module: it is registered once.
                self._plugins.remove(rec)
                continue
            self._activate(rec, obj, explicit=False)

    def register(self, plugin: object, name: str | None = None) -> PluginInfo:
        """Register a plugin object (a module, class or instance with ``@hookimpl`` functions)
        and call its registration hooks. For tests and for embedding kvframe.

        The block list does not apply: this is code, not discovery.

        :param plugin: the plugin object.
        :param name: its plugin name; default its ``__name__`` (modules, classes) or its
            class name.
        :returns: what was registered.
        :raises PluginError: the name is taken, the object has no kvframe hooks or an unknown
            one, a hook raised or called ``register`` with bad arguments.
        :raises PluginConflictError: it registers a name another plugin already has.

        On any error nothing of this plugin stays registered and the host is unchanged.
        """
        if name is None:
            name = getattr(plugin, "__name__", None) or type(plugin).__qualname__
        if any(p.name == name and p.status is PluginStatus.LOADED for p in self._plugins):
            raise PluginError(
                f"a plugin named {name!r} is already registered; pass another name= "
                "or unregister nothing twice"
            )
        rec = _Plugin(name=name, source=PluginSource.CODE)
        self._activate(rec, plugin, explicit=True)
        self._plugins.append(rec)
        return rec.info()

    def _fail(self, rec: _Plugin, what: str, cause: BaseException | None) -> PluginError:
        if rec.source is PluginSource.CODE:
            advice = "Nothing of it was registered; the host is unchanged"
        else:
            advice = (
                "Other plugins are unaffected; fix or upgrade the plugin, or skip it with "
                f"{ENV_BLOCK_PLUGINS}={rec.name}"
            )
        err = PluginError(f"{rec.describe()} failed: {what}. {advice}")
        err.__cause__ = cause
        rec.status = PluginStatus.FAILED
        rec.error = err
        return err

    def _activate(self, rec: _Plugin, obj: object, *, explicit: bool) -> None:
        """Register ``obj`` with pluggy, run its registration hooks, commit what it registered.

        All-or-nothing: on failure the plugin is unregistered and nothing it registered stays.
        Explicit registrations raise; discovered ones are recorded on ``rec``.
        """
        pm = self._pm
        try:
            try:
                pm.register(obj, name=rec.pluggy_name())
            except (pluggy.PluginValidationError, ValueError) as exc:
                # pluggy's useful detail is on the later lines of its message.
                detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
                raise _Reject(f"pluggy refused it: {detail}", exc) from exc
            try:
                self._check_hooks(obj)
                staged = self._run_hooks(rec, obj)
                if explicit:
                    for entry in staged:
                        others = self._registry[entry.kind].get(entry.name, [])
                        if others:
                            raise self._conflict(entry.kind, entry.name, [*others, entry])
            except BaseException:
                pm.unregister(obj)
                raise
        except _Reject as rej:
            err = self._fail(rec, rej.what, rej.cause)
            if explicit:
                raise err from rej.cause
            return
        rec.obj = obj
        for entry in staged:
            self._registry[entry.kind].setdefault(entry.name, []).append(entry)
            rec.names[entry.kind].append(entry.name)

    def _check_hooks(self, obj: object) -> None:
        known = hookspecs.hookspec_names()
        callers = self._pm.get_hookcallers(obj) or []
        for caller in callers:
            if caller.has_spec():
                continue
            if all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is obj):
                continue
            close = difflib.get_close_matches(caller.name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise _Reject(
                f"it implements {caller.name!r}, which is not a kvframe hook{hint} "
                f"(hooks: {', '.join(known)})",
                None,
            )
        if not callers:
            unmarked = sorted(
                a for a in dir(obj) if a.startswith("kvframe_") and callable(getattr(obj, a))
            )
            hint = (
                f"; {', '.join(unmarked)} must be decorated with @kvframe.spi.hookspecs.hookimpl"
                if unmarked
                else f" (define functions marked @hookimpl named {', '.join(known)})"
            )
            raise _Reject(f"it implements no kvframe hook{hint}", None)

    def _run_hooks(self, rec: _Plugin, obj: object) -> list[_Entry]:
        staged: list[_Entry] = []
        others = [p for p in self._pm.get_plugins() if p is not obj]
        for kind in Kind:
            register = _Registrar(kind, rec, staged)
            caller = self._pm.subset_hook_caller(kind.hook, remove_plugins=others)
            try:
                caller(register=register)
            except _Reject:
                raise
            except Exception as exc:
                raise _Reject(f"its {kind.hook} hook raised {_first_line(exc)}", exc) from exc
            if register.failure is not None:
                # The hook swallowed the error its bad register() call raised.
                raise register.failure
        return staged

    # -- results --------------------------------------------------------------------------
    def plugins(self) -> tuple[PluginInfo, ...]:
        """Every plugin the host has seen, in load order: loaded, failed and blocked."""
        return tuple(p.info() for p in self._plugins)

    def errors(self) -> tuple[PluginError, ...]:
        """Every problem found so far: plugins that failed (and listing entry points failing),
        then one :class:`~kvframe.errors.PluginConflictError` per ambiguous name."""
        out: list[PluginError] = list(self._host_errors)
        out.extend(p.error for p in self._plugins if p.error is not None)
        for kind in Kind:
            for name, entries in sorted(self._registry[kind].items()):
                if len(entries) > 1:
                    out.append(self._conflict(kind, name, entries))
        return tuple(out)

    def check(self) -> None:
        """Raise if any plugin failed or any name is ambiguous; do nothing otherwise.

        :raises PluginError: the only problem (its own class, e.g.
            :class:`~kvframe.errors.PluginConflictError`), or one error listing all of them,
            chained to the first. The host stays usable.
        """
        errs = self.errors()
        if len(errs) == 1:
            raise errs[0]
        if errs:
            lines = "\n".join(f"- {e}" for e in errs)
            raise PluginError(f"{len(errs)} plugin problems:\n{lines}") from errs[0]

    def registrations(self, kind: Kind) -> tuple[Registration, ...]:
        """Everything registered as ``kind``, by name, then in registration order; an
        ambiguous name appears once per plugin that registered it."""
        out: list[Registration] = []
        for name, entries in sorted(self._registry[kind].items()):
            for e in entries:
                out.append(
                    Registration(
                        kind=kind,
                        name=name,
                        obj=e.obj,
                        capabilities=e.capabilities,
                        plugin=e.plugin.name,
                        distribution=e.plugin.distribution,
                        version=e.plugin.version,
                        ambiguous=len(entries) > 1,
                    )
                )
        return tuple(out)

    def names(self, kind: Kind) -> tuple[str, ...]:
        """The registered names of ``kind``, sorted (ambiguous names included)."""
        return tuple(sorted(self._registry[kind]))

    def _entry(self, kind: Kind, name: str) -> _Entry:
        entries = self._registry[kind].get(name)
        if not entries:
            raise PluginNotFoundError(self._not_found_message(kind, name))
        if len(entries) > 1:
            raise self._conflict(kind, name, entries)
        return entries[0]

    def _conflict(self, kind: Kind, name: str, entries: Sequence[_Entry]) -> PluginConflictError:
        owners = [e.plugin for e in entries]
        who = " and ".join(p.describe() for p in owners)
        how = " or ".join(p.block_hint() for p in owners)
        return PluginConflictError(
            f"{kind.value} {name!r} is registered by more than one plugin: {who}. Keep one: "
            f"uninstall the other, or set {how}"
        )

    def _not_found_message(self, kind: Kind, name: str) -> str:
        installed = self.names(kind)
        parts = [f"no {kind.value} named {name!r} is registered."]
        if installed:
            parts.append(f"Installed {kind.plural}: {', '.join(installed)}.")
            same_case = [n for n in installed if n.lower() == name.lower()]
            close = same_case or difflib.get_close_matches(name, installed, n=1)
            if close:
                parts.append(f"Did you mean {close[0]!r}?")
        else:
            parts.append(f"No {kind.plural} are installed.")
        if not self._loaded:
            parts.append("The host has not loaded plugins yet: call PluginHost.load() first.")
        elif not self._autoload:
            parts.append(
                f"Entry-point plugins were not loaded ({ENV_DISABLE_PLUGIN_AUTOLOAD} is set)."
            )
        failed = [p for p in self._plugins if p.status is PluginStatus.FAILED]
        if failed:
            listed = "; ".join(f"{p.describe()}" for p in failed)
            parts.append(
                f"{len(failed)} plugin(s) failed to load and may provide it: {listed}. "
                "Run `kvframe plugins` for the errors."
            )
        blocked = [p.name for p in self._plugins if p.status is PluginStatus.BLOCKED]
        if blocked:
            parts.append(f"Blocked by {ENV_BLOCK_PLUGINS}: {', '.join(blocked)}.")
        return " ".join(parts)

    # -- transports -----------------------------------------------------------------------
    def transport_names(self) -> tuple[str, ...]:
        """Registered transport names, sorted."""
        return self.names(Kind.TRANSPORT)

    def transport_info(self, name: str) -> TransportInfo:
        """The transport registered as ``name``.

        :raises PluginNotFoundError: nothing registered ``name``; the message lists what is
            installed, the closest match and plugins that failed to load.
        :raises PluginConflictError: two plugins registered ``name``.
        """
        e = self._entry(Kind.TRANSPORT, name)
        assert e.capabilities is not None
        return TransportInfo(
            name=name,
            factory=e.obj,
            capabilities=e.capabilities,
            plugin=e.plugin.name,
            distribution=e.plugin.distribution,
            version=e.plugin.version,
        )

    def create_transport(self, name: str, params: TransportParams) -> Transport:
        """Build a new transport with the factory registered as ``name``.

        :raises PluginNotFoundError: as :meth:`transport_info`.
        :raises PluginConflictError: as :meth:`transport_info`.
        :raises KVFrameError: whatever kvframe error the factory raises (typically
            :class:`~kvframe.errors.ConfigError` for bad options), unchanged.
        :raises PluginError: the factory raised anything else, or returned something that is
            not a :class:`~kvframe.spi.transport.Transport` (the message names the plugin;
            the original exception is the cause). No transport is left open by the host.
        """
        built = self._build(
            Kind.TRANSPORT, name, params, Transport, "kvframe.spi.transport.Transport"
        )
        assert isinstance(built, Transport)
        return built

    # -- connectors -----------------------------------------------------------------------
    def connector_names(self) -> tuple[str, ...]:
        """Registered connector names, sorted."""
        return self.names(Kind.CONNECTOR)

    def connector_info(self, name: str) -> ConnectorInfo:
        """The connector registered as ``name``; raises as :meth:`transport_info`."""
        e = self._entry(Kind.CONNECTOR, name)
        return ConnectorInfo(
            name=name,
            connector=e.obj,
            plugin=e.plugin.name,
            distribution=e.plugin.distribution,
            version=e.plugin.version,
        )

    def connector(self, name: str) -> type[KVConnector]:
        """The connector class registered as ``name``; raises as :meth:`transport_info`."""
        return self.connector_info(name).connector

    # -- offload tiers and eviction policies ----------------------------------------------
    def _component(self, kind: Kind, name: str) -> ComponentInfo:
        e = self._entry(kind, name)
        return ComponentInfo(
            kind=kind,
            name=name,
            factory=e.obj,
            plugin=e.plugin.name,
            distribution=e.plugin.distribution,
            version=e.plugin.version,
        )

    def offload_tier_names(self) -> tuple[str, ...]:
        """Registered offload-tier names, sorted."""
        return self.names(Kind.OFFLOAD_TIER)

    def offload_tier_info(self, name: str) -> ComponentInfo:
        """The offload tier registered as ``name``; raises as :meth:`transport_info`."""
        return self._component(Kind.OFFLOAD_TIER, name)

    def offload_tier(self, name: str) -> Callable[..., Any]:
        """The offload-tier factory registered as ``name``; raises as :meth:`transport_info`."""
        return self.offload_tier_info(name).factory

    def eviction_policy_names(self) -> tuple[str, ...]:
        """Registered eviction-policy names, sorted."""
        return self.names(Kind.EVICTION_POLICY)

    def eviction_policy_info(self, name: str) -> ComponentInfo:
        """The eviction policy registered as ``name``; raises as :meth:`transport_info`."""
        return self._component(Kind.EVICTION_POLICY, name)

    def eviction_policy(self, name: str) -> Callable[..., Any]:
        """The eviction-policy factory registered as ``name``; raises as
        :meth:`transport_info`."""
        return self.eviction_policy_info(name).factory

    # -- discovery backends ---------------------------------------------------------------
    def discovery_backend_names(self) -> tuple[str, ...]:
        """Registered discovery-backend names, sorted."""
        return self.names(Kind.DISCOVERY)

    def discovery_backend_info(self, name: str) -> ComponentInfo:
        """The discovery backend registered as ``name``; raises as :meth:`transport_info`."""
        return self._component(Kind.DISCOVERY, name)

    def create_discovery(self, name: str, params: DiscoveryParams) -> Discovery:
        """Build a discovery backend with the factory registered as ``name``.

        :raises PluginNotFoundError: as :meth:`transport_info`.
        :raises PluginConflictError: as :meth:`transport_info`.
        :raises KVFrameError: whatever kvframe error the factory raises (typically
            :class:`~kvframe.errors.ConfigError` for bad options), unchanged.
        :raises PluginError: the factory raised anything else or returned something that is
            not a :class:`~kvframe.spi.discovery.Discovery` (the message names the plugin).
        """
        built = self._build(
            Kind.DISCOVERY, name, params, Discovery, "kvframe.spi.discovery.Discovery"
        )
        assert isinstance(built, Discovery)
        return built

    def _build(self, kind: Kind, name: str, params: object, want: type, what: str) -> object:
        """Call the factory registered as ``name``; kvframe errors pass, others and a wrong
        result become a :class:`PluginError` naming the plugin."""
        e = self._entry(kind, name)
        try:
            built = e.obj(params)
        except KVFrameError:
            raise
        except Exception as exc:
            raise PluginError(
                f"the factory of {kind.value} {name!r} from {e.plugin.describe()} raised "
                f"{_first_line(exc)}"
            ) from exc
        if not isinstance(built, want):
            raise PluginError(
                f"the factory of {kind.value} {name!r} from {e.plugin.describe()} returned "
                f"{type(built).__name__}, not a {what}; the plugin is broken (report it to its "
                "authors)"
            )
        return built


class _Reject(Exception):
    """Internal: a plugin is refused; carries the reason and the original exception."""

    def __init__(self, what: str, cause: BaseException | None) -> None:
        super().__init__(what)
        self.what = what
        self.cause = cause


def _signature(second: str, *, with_capabilities: bool = False) -> inspect.Signature:
    P = inspect.Parameter
    params = [P("name", P.POSITIONAL_OR_KEYWORD), P(second, P.POSITIONAL_OR_KEYWORD)]
    if with_capabilities:
        params.append(P("capabilities", P.KEYWORD_ONLY))
    return inspect.Signature(params)


# Mirrors the registrar Protocols in kvframe.spi.hookspecs (tests check they agree).
_REGISTER_SIGNATURES = {
    Kind.TRANSPORT: _signature("factory", with_capabilities=True),
    Kind.CONNECTOR: _signature("connector"),
    Kind.OFFLOAD_TIER: _signature("factory"),
    Kind.EVICTION_POLICY: _signature("factory"),
    Kind.DISCOVERY: _signature("factory"),
}


class _Registrar:
    """The ``register`` callback handed to one plugin's hook for one kind.

    Validates every call at once and stages the registration; the host commits the staged
    entries only when all of the plugin's hooks succeeded.
    """

    def __init__(self, kind: Kind, plugin: _Plugin, staged: list[_Entry]) -> None:
        self._kind = kind
        self._plugin = plugin
        self._staged = staged
        self.failure: _Reject | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        kind = self._kind
        name, obj, *rest = self._bind(args, kwargs)
        caps = rest[0] if rest else None
        self._check_name(name)
        if kind is Kind.TRANSPORT:
            if not callable(obj):
                self._bad(f"the factory for transport {name!r} is {obj!r}, which is not callable")
            if not isinstance(caps, TransportCapabilities):
                self._bad(
                    f"capabilities for transport {name!r} must be a "
                    f"kvframe.spi.transport.TransportCapabilities, got {type(caps).__name__}"
                )
        elif kind is Kind.CONNECTOR:
            self._check_connector(name, obj)
        elif not callable(obj):
            self._bad(f"the factory for {kind.value} {name!r} is {obj!r}, which is not callable")
        if any(e.kind is kind and e.name == name for e in self._staged):
            self._bad(f"it registered {kind.value} {name!r} twice")
        self._staged.append(
            _Entry(kind=kind, name=name, obj=obj, capabilities=caps, plugin=self._plugin)
        )

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """Bind a call to the signature the registrar Protocol declares for this kind."""
        sig = _REGISTER_SIGNATURES[self._kind]
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            self._bad(f"call register{sig} ({exc})")
        return [bound.arguments[p] for p in sig.parameters]

    def _check_name(self, name: Any) -> None:
        if not isinstance(name, str) or NAME_RULE.fullmatch(name) is None:
            self._bad(
                f"{self._kind.value} name {name!r} is not allowed: use 1-64 letters, digits, "
                "'.', '_' or '-', starting with a letter or digit"
            )

    def _check_connector(self, name: str, obj: Any) -> None:
        if not isinstance(obj, type):
            self._bad(
                f"connector {name!r} must be a class (a KVConnector subclass), got "
                f"{type(obj).__name__} {obj!r}"
            )
        where = f"{obj.__module__}.{obj.__qualname__}"
        if not issubclass(obj, KVConnector):
            self._bad(
                f"connector {name!r} is {where}, which is not a subclass of "
                "kvframe.spi.connector.KVConnector"
            )
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
            self._bad(f"connector {name!r} ({where}) leaves abstract: {missing}; implement them")

    def _bad(self, what: str) -> NoReturn:
        self.failure = _Reject(f"{self._kind.hook} called register wrongly: {what}", None)
        raise self.failure
