"""The plugin host: discovery, env switches, clashes, unknown names, broken plugins, isolation."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.errors import ConfigError, PluginConflictError, PluginError, PluginNotFoundError
from kvframe.runtime.plugins import (
    BUILTIN_PLUGINS,
    ENV_BLOCK_PLUGINS,
    ENV_DISABLE_PLUGIN_AUTOLOAD,
    Kind,
    PluginHost,
    PluginSource,
    PluginStatus,
)
from kvframe.spi.transport import MemoryKind, TransportCapabilities, TransportParams

from .fakes import (
    CAPS,
    AbstractConnector,
    FakeConnector,
    FakeTransport,
    ep,
    make_plugin,
    transport_plugin,
)


def host_with(*eps: Any, env: dict[str, str] | None = None, **kwargs: Any) -> PluginHost:
    """A host that sees only ``eps`` (no built-ins, no process environment)."""
    kwargs.setdefault("builtins", ())
    return PluginHost(env=env or {}, entry_points=lambda: list(eps), **kwargs)


# -- discovery ----------------------------------------------------------------------------


def test_entry_point_plugin_is_registered_with_its_distribution() -> None:
    host = host_with(ep("fast", transport_plugin("fast"), dist="kvframe-fast", version="2.3"))
    host.load()
    info = host.transport_info("fast")
    assert (info.plugin, info.distribution, info.version) == ("fast", "kvframe-fast", "2.3")
    assert info.capabilities == CAPS
    (plugin,) = host.plugins()
    assert plugin.source is PluginSource.ENTRY_POINT
    assert plugin.status is PluginStatus.LOADED
    assert plugin.transports == ("fast",)
    assert plugin.target == "kvframe_fast_fast.plugin"
    assert host.errors() == ()


def test_real_builtins_load_through_the_hooks() -> None:
    host = PluginHost(env={}, entry_points=list)
    host.load(strict=True)
    # Every built-in loads, in the declared order, as an ordinary plugin of kvframe itself.
    assert [(p.name, p.source, p.status, p.distribution) for p in host.plugins()] == [
        (name, PluginSource.BUILTIN, PluginStatus.LOADED, "kvframe") for name, _ in BUILTIN_PLUGINS
    ]
    assert host.connector_info("PDConnector").plugin == "pd"
    info = host.transport_info("inprocess")
    assert info.capabilities.cross_process is False
    transport = host.create_transport("inprocess", TransportParams(name="builtin-test"))
    try:
        assert transport.name == "builtin-test"
    finally:
        transport.close()


def test_builtin_modules_are_imported_and_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_builtin_mod", transport_plugin("local"))
    host = PluginHost(env={}, entry_points=list, builtins=[("local", "fake_builtin_mod")])
    host.load()
    assert host.transport_info("local").distribution == "kvframe"
    assert host.plugins()[0].source is PluginSource.BUILTIN


def test_broken_builtin_is_recorded_not_raised() -> None:
    host = PluginHost(env={}, entry_points=list, builtins=[("gone", "kvframe_no_such_module_x")])
    host.load()
    (plugin,) = host.plugins()
    assert plugin.status is PluginStatus.FAILED
    assert plugin.error is not None
    assert "kvframe_no_such_module_x" in str(plugin.error)
    assert isinstance(plugin.error.__cause__, ImportError)


def test_load_is_idempotent() -> None:
    entry = ep("fast", transport_plugin("fast"))
    calls = []

    def source() -> list[Any]:
        calls.append(1)
        return [entry]

    host = PluginHost(env={}, entry_points=source, builtins=())
    host.load()
    host.load()
    assert len(calls) == 1
    assert entry.loads == 1
    assert len(host.plugins()) == 1
    assert host.loaded


def test_stale_entry_point_for_a_builtin_module_is_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mod = transport_plugin("local")
    monkeypatch.setitem(sys.modules, "fake_builtin_mod", mod)
    stale = ep("local", mod, dist="kvframe")
    stale.value = "fake_builtin_mod"
    host = PluginHost(
        env={}, entry_points=lambda: [stale], builtins=[("local", "fake_builtin_mod")]
    )
    host.load()
    assert stale.loads == 0
    assert host.errors() == ()
    assert len(host.plugins()) == 1


def test_duplicate_and_aliased_entry_points_register_once() -> None:
    mod = transport_plugin("fast")
    first = ep("fast", mod, dist="kvframe-fast")
    again = ep("fast", mod, dist="kvframe_fast")  # the same distribution found twice
    alias = ep("fast-alias", mod, dist="other")  # another entry point naming the same module
    host = host_with(first, again, alias)
    host.load()
    assert [p.name for p in host.plugins()] == ["fast"]
    assert host.errors() == ()


def test_failing_entry_point_listing_is_recorded() -> None:
    def broken() -> list[Any]:
        raise OSError("metadata unreadable")

    host = PluginHost(env={}, entry_points=broken, builtins=())
    host.load()
    (err,) = host.errors()
    assert "entry points" in str(err)
    assert isinstance(err.__cause__, OSError)


def test_plugin_registered_after_load_gets_its_hooks_called() -> None:
    host = host_with(ep("fast", transport_plugin("fast")))
    host.load()
    host.register(transport_plugin("late"), name="late")
    assert host.transport_names() == ("fast", "late")


def test_all_four_kinds_are_registered_and_looked_up() -> None:
    Conn = FakeConnector

    def tier(config: Any) -> Any:
        return ("tier", config)

    def policy(config: Any) -> Any:
        return ("policy", config)

    plugin = make_plugin(
        "everything",
        kvframe_register_transports=lambda register: register(
            "t", FakeTransport.factory, capabilities=CAPS
        ),
        kvframe_register_connectors=lambda register: register("c", Conn),
        kvframe_register_offload_tiers=lambda register: register("disk", tier),
        kvframe_register_eviction_policies=lambda register: register("lru", policy),
    )
    host = host_with()
    info = host.register(plugin)
    assert (info.transports, info.connectors, info.offload_tiers, info.eviction_policies) == (
        ("t",),
        ("c",),
        ("disk",),
        ("lru",),
    )
    assert host.connector_names() == ("c",)
    assert host.connector("c") is Conn
    assert host.connector_info("c").plugin == "everything"
    assert host.offload_tier_names() == ("disk",)
    assert host.offload_tier("disk")({"a": 1}) == ("tier", {"a": 1})
    assert host.offload_tier_info("disk").kind is Kind.OFFLOAD_TIER
    assert host.eviction_policy_names() == ("lru",)
    assert host.eviction_policy("lru")({}) == ("policy", {})
    assert host.eviction_policy_info("lru").distribution is None
    assert [r.name for r in host.registrations(Kind.CONNECTOR)] == ["c"]


def test_create_transport_calls_the_factory() -> None:
    host = host_with(ep("fast", transport_plugin("fast")))
    host.load()
    t = host.create_transport("fast", TransportParams(name="x"))
    assert isinstance(t, FakeTransport)
    assert t.name == "x"


# -- environment switches -----------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_autoload_off_skips_entry_points_but_loads_builtins(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "fake_builtin_mod", transport_plugin("local"))
    entry = ep("fast", transport_plugin("fast"))
    host = PluginHost(
        env={ENV_DISABLE_PLUGIN_AUTOLOAD: value},
        entry_points=lambda: [entry],
        builtins=[("local", "fake_builtin_mod")],
    )
    host.load()
    assert not host.autoload
    assert entry.loads == 0
    assert host.transport_names() == ("local",)
    with pytest.raises(PluginNotFoundError, match=ENV_DISABLE_PLUGIN_AUTOLOAD):
        host.transport_info("fast")


@pytest.mark.parametrize("value", ["", "0", "false", "off"])
def test_autoload_stays_on_for_false_values(value: str) -> None:
    host = host_with(ep("fast", transport_plugin("fast")), env={ENV_DISABLE_PLUGIN_AUTOLOAD: value})
    host.load()
    assert host.transport_names() == ("fast",)


def test_autoload_argument_overrides_the_environment() -> None:
    host = host_with(
        ep("fast", transport_plugin("fast")),
        env={ENV_DISABLE_PLUGIN_AUTOLOAD: "1"},
        autoload=True,
    )
    host.load()
    assert host.transport_names() == ("fast",)


def test_unreadable_autoload_value_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=f"{ENV_DISABLE_PLUGIN_AUTOLOAD}='maybe'"):
        PluginHost(env={ENV_DISABLE_PLUGIN_AUTOLOAD: "maybe"})


def test_process_environment_is_read_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISABLE_PLUGIN_AUTOLOAD, "1")
    monkeypatch.setenv(ENV_BLOCK_PLUGINS, "a,b")
    host = PluginHost()
    assert not host.autoload
    assert host.blocked == {"a", "b"}


def test_blocked_plugin_is_not_imported() -> None:
    blocked = ep("bad", RuntimeError("must not be imported"), dist="kvframe-bad")
    kept = ep("good", transport_plugin("good"), dist="kvframe-good")
    host = host_with(blocked, kept, env={ENV_BLOCK_PLUGINS: " bad , "})
    host.load()
    assert blocked.loads == 0
    assert [(p.name, p.status) for p in host.plugins()] == [
        ("bad", PluginStatus.BLOCKED),
        ("good", PluginStatus.LOADED),
    ]
    assert host.errors() == ()
    with pytest.raises(PluginNotFoundError, match="Blocked by KVFRAME_BLOCK_PLUGINS: bad"):
        host.transport_info("bad")


def test_block_by_distribution_name_is_normalized() -> None:
    blocked = ep("x", transport_plugin("x"), dist="Kvframe_Fast.Wire")
    host = host_with(blocked, block=["kvframe-fast-wire", "typo-name"])
    host.load()
    assert blocked.loads == 0
    assert host.plugins()[0].status is PluginStatus.BLOCKED
    assert host.unmatched_blocks() == ("typo-name",)


def test_blocking_kvframe_blocks_the_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fake_builtin_mod", transport_plugin("local"))
    host = PluginHost(
        env={ENV_BLOCK_PLUGINS: "kvframe"},
        entry_points=list,
        builtins=[("local", "fake_builtin_mod")],
    )
    host.load()
    assert host.plugins()[0].status is PluginStatus.BLOCKED
    assert host.transport_names() == ()


def test_block_list_does_not_apply_to_explicit_registration() -> None:
    host = host_with(block=["mine"])
    host.register(transport_plugin("t"), name="mine")
    assert host.transport_names() == ("t",)


def test_block_given_as_one_string_is_a_comma_separated_list() -> None:
    assert PluginHost(env={}, block="nixl, ucx").blocked == {"nixl", "ucx"}
    assert PluginHost(env={}, block=["a,b", "c"]).blocked == {"a", "b", "c"}


def test_non_string_block_item_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="must be strings"):
        PluginHost(env={}, block=[3])  # type: ignore[list-item]


# -- clashes ------------------------------------------------------------------------------


def test_clash_between_discovered_plugins_makes_the_name_ambiguous() -> None:
    a = ep("alpha", transport_plugin("fast", "only-a"), dist="kvframe-alpha", version="1.0")
    b = ep("beta", transport_plugin("fast", "only-b"), dist="kvframe-beta", version="2.0")
    host = host_with(a, b)
    host.load()  # a clash does not stop loading
    with pytest.raises(PluginConflictError) as exc_info:
        host.transport_info("fast")
    msg = str(exc_info.value)
    for needle in ("kvframe-alpha 1.0", "kvframe-beta 2.0", "KVFRAME_BLOCK_PLUGINS=alpha"):
        assert needle in msg
    assert "KVFRAME_BLOCK_PLUGINS=beta" in msg
    with pytest.raises(PluginConflictError):
        host.create_transport("fast", TransportParams(name="x"))
    # Everything else of both plugins stays usable.
    assert host.transport_info("only-a").plugin == "alpha"
    assert host.transport_info("only-b").plugin == "beta"
    assert "fast" in host.transport_names()
    (conflict,) = host.errors()
    assert isinstance(conflict, PluginConflictError)
    assert [r.ambiguous for r in host.registrations(Kind.TRANSPORT) if r.name == "fast"] == [
        True,
        True,
    ]
    with pytest.raises(PluginConflictError):
        host.check()
    with pytest.raises(PluginConflictError):
        host.load(strict=True)


def test_blocking_one_side_resolves_a_clash() -> None:
    a = ep("alpha", transport_plugin("fast"), dist="kvframe-alpha")
    b = ep("beta", transport_plugin("fast"), dist="kvframe-beta")
    host = host_with(a, b, env={ENV_BLOCK_PLUGINS: "kvframe-beta"})
    host.load(strict=True)
    assert host.transport_info("fast").distribution == "kvframe-alpha"


def test_explicit_registration_clash_raises_and_registers_nothing() -> None:
    host = host_with(ep("alpha", transport_plugin("fast"), dist="kvframe-alpha"))
    host.load()
    with pytest.raises(PluginConflictError, match="kvframe-alpha") as exc_info:
        host.register(transport_plugin("extra", "fast"), name="mine")
    assert "stop registering plugin 'mine'" in str(exc_info.value)
    assert host.transport_names() == ("fast",)
    assert [p.name for p in host.plugins()] == ["alpha"]
    assert host.errors() == ()
    # The same object can be registered once the clash is gone (it was fully unregistered).
    other = host_with()
    other.register(transport_plugin("extra", "fast"), name="mine")


def test_connector_clash_is_reported_too() -> None:
    def reg_conn(register: Any) -> None:
        register("pd", FakeConnector)

    host = host_with(
        ep("one", make_plugin("one", kvframe_register_connectors=reg_conn), dist="d-one"),
        ep("two", make_plugin("two", kvframe_register_connectors=reg_conn), dist="d-two"),
    )
    host.load()
    with pytest.raises(PluginConflictError, match=r"connector 'pd'.*d-one.*d-two"):
        host.connector("pd")


# -- unknown names ------------------------------------------------------------------------


def test_unknown_name_lists_installed_and_suggests_the_closest() -> None:
    host = host_with(ep("n", transport_plugin("nixl", "ucx", "inprocess")))
    host.load()
    with pytest.raises(PluginNotFoundError) as exc_info:
        host.create_transport("nixll", TransportParams(name="x"))
    msg = str(exc_info.value)
    assert "no transport named 'nixll'" in msg
    assert "Installed transports: inprocess, nixl, ucx." in msg
    assert "Did you mean 'nixl'?" in msg
    assert isinstance(exc_info.value, LookupError)


def test_unknown_name_differing_in_case_suggests_the_registered_spelling() -> None:
    host = host_with()
    host.register(
        make_plugin(
            "c", kvframe_register_connectors=lambda register: register("PDConnector", FakeConnector)
        )
    )
    with pytest.raises(PluginNotFoundError, match="Did you mean 'PDConnector'"):
        host.connector("pdconnector")


def test_unknown_name_with_nothing_installed() -> None:
    host = host_with()
    host.load()
    with pytest.raises(PluginNotFoundError, match="No eviction policies are installed"):
        host.eviction_policy("lru")
    with pytest.raises(PluginNotFoundError, match="No offload tiers are installed"):
        host.offload_tier_info("disk")


def test_unknown_name_before_load_says_to_load() -> None:
    host = host_with(ep("fast", transport_plugin("fast")))
    with pytest.raises(PluginNotFoundError, match=r"call PluginHost.load\(\) first"):
        host.transport_info("fast")


def test_unknown_name_mentions_plugins_that_failed() -> None:
    broken = ep("nixl", ImportError("libnixl.so: cannot open"), dist="kvframe-nixl")
    host = host_with(broken)
    host.load()
    with pytest.raises(PluginNotFoundError, match=r"failed to load.*kvframe-nixl"):
        host.transport_info("nixl")


# -- broken plugins -----------------------------------------------------------------------


def test_entry_point_that_fails_to_import_is_recorded_and_others_load() -> None:
    cause = ImportError("No module named 'kvframe_broken'")
    broken = ep("broken", cause, dist="kvframe-broken", version="0.9")
    good = ep("good", transport_plugin("good"))
    host = host_with(broken, good)
    host.load()
    assert host.transport_names() == ("good",)
    failed = host.plugins()[0]
    assert failed.status is PluginStatus.FAILED
    assert failed.error is not None
    assert failed.error.__cause__ is cause
    msg = str(failed.error)
    for needle in ("kvframe-broken 0.9", "entry point broken = kvframe_broken_broken.plugin"):
        assert needle in msg
    assert "KVFRAME_BLOCK_PLUGINS=broken" in msg
    assert host.errors() == (failed.error,)
    with pytest.raises(PluginError, match="kvframe-broken"):
        host.load(strict=True)


def test_hook_that_raises_withdraws_everything_the_plugin_registered() -> None:
    cause = RuntimeError("device missing")

    def kvframe_register_transports(register: Any) -> None:
        register("half", FakeTransport.factory, capabilities=CAPS)
        raise cause

    plugin = make_plugin("half", kvframe_register_transports=kvframe_register_transports)
    host = host_with(ep("half", plugin, dist="kvframe-half"), ep("good", transport_plugin("g")))
    host.load()
    assert host.transport_names() == ("g",)
    (err,) = host.errors()
    assert err.__cause__ is cause
    assert "kvframe_register_transports hook raised RuntimeError: device missing" in str(err)
    assert "kvframe-half" in str(err)
    assert host.plugins()[0].transports == ()


def test_explicit_registration_of_a_broken_plugin_raises() -> None:
    def kvframe_register_connectors(register: Any) -> None:
        raise ValueError("boom")

    host = host_with()
    with pytest.raises(PluginError, match=r"registered by code.*boom") as exc_info:
        host.register(make_plugin("x", kvframe_register_connectors=kvframe_register_connectors))
    assert isinstance(exc_info.value.__cause__, ValueError)
    assert host.plugins() == ()
    assert host.errors() == ()


class _NotAConnector:
    pass


BAD_CALLS: dict[str, tuple[str, Any, str]] = {
    "missing capabilities": (
        "kvframe_register_transports",
        lambda register: register("t", FakeTransport.factory),
        r"call register\(name, factory, \*, capabilities\) \(missing a required argument: "
        "'capabilities'",
    ),
    "capabilities given positionally": (
        "kvframe_register_transports",
        lambda register: register("t", FakeTransport.factory, CAPS),
        "too many positional arguments",
    ),
    "capabilities of the wrong type": (
        "kvframe_register_transports",
        lambda register: register("t", FakeTransport.factory, capabilities={"read": True}),
        "got dict",
    ),
    "factory not callable": (
        "kvframe_register_transports",
        lambda register: register("t", "not-a-factory", capabilities=CAPS),
        "not callable",
    ),
    "space in the name": (
        "kvframe_register_transports",
        lambda register: register("fast wire", FakeTransport.factory, capabilities=CAPS),
        "transport name 'fast wire' is not allowed",
    ),
    "name too long": (
        "kvframe_register_connectors",
        lambda register: register("c" * 65, FakeConnector),
        "use 1-64 letters",
    ),
    "empty name": (
        "kvframe_register_offload_tiers",
        lambda register: register("", dict),
        "offload tier name '' is not allowed",
    ),
    "name not a string": (
        "kvframe_register_eviction_policies",
        lambda register: register(b"lru", dict),
        "eviction policy name b'lru' is not allowed",
    ),
    "too many arguments": (
        "kvframe_register_offload_tiers",
        lambda register: register("disk", dict, "extra"),
        r"call register\(name, factory\) \(too many positional arguments\)",
    ),
    "unknown keyword": (
        "kvframe_register_eviction_policies",
        lambda register: register("lru", dict, fn=dict),
        "got an unexpected keyword argument 'fn'",
    ),
    "connector instance instead of class": (
        "kvframe_register_connectors",
        lambda register: register("c", _NotAConnector()),
        "must be a class",
    ),
    "connector class not a KVConnector": (
        "kvframe_register_connectors",
        lambda register: register("c", _NotAConnector),
        "not a subclass of kvframe.spi.connector.KVConnector",
    ),
    "abstract connector": (
        "kvframe_register_connectors",
        lambda register: register("c", AbstractConnector),
        "leaves abstract: build_worker",
    ),
    "tier factory not callable": (
        "kvframe_register_offload_tiers",
        lambda register: register("disk", 42),
        "not callable",
    ),
    "same name twice": (
        "kvframe_register_eviction_policies",
        lambda register: [register("lru", dict), register("lru", dict)],
        "registered eviction policy 'lru' twice",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_wrong_register_arguments_are_reported_against_the_plugin(case: str) -> None:
    hook, body, expected = BAD_CALLS[case]
    plugin = make_plugin("wrong", **{hook: body})
    host = host_with(ep("wrong", plugin, dist="kvframe-wrong"), ep("ok", transport_plugin("ok")))
    host.load()
    (err,) = host.errors()
    assert "kvframe-wrong" in str(err)
    assert f"{hook} called register wrongly" in str(err)
    assert re.search(expected, str(err)), str(err)
    assert host.transport_names() == ("ok",)
    # An explicit registration of the same plugin raises the same kind of error.
    with pytest.raises(PluginError, match=expected):
        host_with().register(make_plugin("wrong", **{hook: body}))


def test_register_accepts_keywords_as_the_registrar_protocols_declare() -> None:
    plugin = make_plugin(
        "kw",
        kvframe_register_transports=lambda register: register(
            name="t", factory=FakeTransport.factory, capabilities=CAPS
        ),
        kvframe_register_connectors=lambda register: register(name="c", connector=FakeConnector),
        kvframe_register_offload_tiers=lambda register: register("disk", factory=dict),
        kvframe_register_eviction_policies=lambda register: register(name="lru", factory=dict),
    )
    info = host_with().register(plugin)
    assert (info.transports, info.connectors, info.offload_tiers, info.eviction_policies) == (
        ("t",),
        ("c",),
        ("disk",),
        ("lru",),
    )


def test_register_signatures_match_the_registrar_protocols() -> None:
    from kvframe.runtime import plugins
    from kvframe.spi import hookspecs

    protocols = {
        Kind.TRANSPORT: hookspecs.TransportRegistrar,
        Kind.CONNECTOR: hookspecs.ConnectorRegistrar,
        Kind.OFFLOAD_TIER: hookspecs.OffloadTierRegistrar,
        Kind.EVICTION_POLICY: hookspecs.EvictionPolicyRegistrar,
        Kind.DISCOVERY: hookspecs.DiscoveryRegistrar,
    }
    for kind, proto in protocols.items():
        declared = inspect.signature(proto.__call__).parameters
        expected = [(p.name, p.kind) for p in declared.values() if p.name != "self"]
        actual = plugins._REGISTER_SIGNATURES[kind].parameters.values()
        assert [(p.name, p.kind) for p in actual] == expected, kind


def test_hook_that_swallows_a_register_error_still_fails() -> None:
    def kvframe_register_transports(register: Any) -> None:
        with contextlib.suppress(Exception):
            register("t", FakeTransport.factory)

    host = host_with()
    with pytest.raises(PluginError, match="called register wrongly"):
        host.register(make_plugin("sly", kvframe_register_transports=kvframe_register_transports))


def test_misspelled_hook_is_refused_with_a_suggestion() -> None:
    plugin = make_plugin("typo", kvframe_register_transport=lambda register: None)
    host = host_with()
    with pytest.raises(PluginError, match="did you mean 'kvframe_register_transports'"):
        host.register(plugin)
    assert host.plugins() == ()


def test_plugin_without_hooks_is_refused() -> None:
    plugin = types.ModuleType("unmarked")
    plugin.kvframe_register_transports = lambda register: None  # type: ignore[attr-defined]
    with pytest.raises(
        PluginError, match=r"must be decorated with @kvframe\.spi\.hookspecs\.hookimpl"
    ):
        host_with().register(plugin)
    with pytest.raises(PluginError, match="implements no kvframe hook"):
        host_with().register(types.ModuleType("empty"))


def test_hookimpl_with_arguments_the_spec_lacks_is_refused() -> None:
    plugin = make_plugin("extra", kvframe_register_transports=lambda register, config: None)
    host = host_with(ep("extra", plugin))
    host.load()
    (err,) = host.errors()
    assert "pluggy refused it" in str(err)
    assert "Argument(s) {'config'} are declared in the hookimpl" in str(err)


def test_registering_a_taken_plugin_name_is_refused() -> None:
    host = host_with()
    host.register(transport_plugin("a"), name="same")
    with pytest.raises(PluginError, match="'same' is already registered"):
        host.register(transport_plugin("b"), name="same")
    assert host.transport_names() == ("a",)


def test_factory_errors() -> None:
    def config_error(params: TransportParams) -> Any:
        raise ConfigError("unknown option 'x'")

    def crash(params: TransportParams) -> Any:
        raise RuntimeError("native library crashed")

    def wrong_type(params: TransportParams) -> Any:
        return object()

    def reg(register: Any) -> None:
        register("cfg", config_error, capabilities=CAPS)
        register("crash", crash, capabilities=CAPS)
        register("wrong", wrong_type, capabilities=CAPS)

    host = host_with(ep("f", make_plugin("f", kvframe_register_transports=reg), dist="d-f"))
    host.load()
    params = TransportParams(name="x")
    with pytest.raises(ConfigError, match="unknown option"):
        host.create_transport("cfg", params)
    with pytest.raises(PluginError, match=r"transport 'crash' from plugin 'f'.*d-f") as exc_info:
        host.create_transport("crash", params)
    assert isinstance(exc_info.value.__cause__, RuntimeError)
    with pytest.raises(PluginError, match="returned object, not a"):
        host.create_transport("wrong", params)


def test_check_collects_several_problems() -> None:
    host = host_with(
        ep("a", ImportError("a"), dist="d-a"),
        ep("b", ImportError("b"), dist="d-b"),
    )
    host.load()
    with pytest.raises(PluginError, match="2 plugin problems") as exc_info:
        host.check()
    assert exc_info.value.__cause__ is host.errors()[0]


def test_entry_point_without_distribution() -> None:
    host = host_with(ep("loose", transport_plugin("loose"), dist=None))
    host.load()
    info = host.transport_info("loose")
    assert (info.distribution, info.version) == (None, None)
    assert "unknown distribution" in host.plugins()[0].describe()


# -- isolation ----------------------------------------------------------------------------


def test_two_hosts_do_not_share_registrations() -> None:
    plugin = transport_plugin("shared")
    one = host_with(ep("p", plugin))
    two = host_with(env={ENV_BLOCK_PLUGINS: "p"})
    one.load()
    two.load()
    assert one.transport_names() == ("shared",)
    assert two.transport_names() == ()
    two.register(transport_plugin("only-two"), name="only-two")
    assert one.transport_names() == ("shared",)
    # The same plugin object may live in both hosts without clashing.
    two.register(plugin, name="p")
    assert two.transport_names() == ("only-two", "shared")


# -- a property: names, ambiguity and lookups agree with a plain model --------------------

_NAMES = st.sampled_from(["a", "b", "c", "d"])


@given(st.lists(st.lists(_NAMES, unique=True, max_size=3), max_size=4))
def test_lookups_match_a_model_of_who_registered_what(plan: list[list[str]]) -> None:
    eps = [
        ep(f"p{i}", transport_plugin(*names, name=f"p{i}"), dist=f"d{i}")
        for i, names in enumerate(plan)
    ]
    host = host_with(*eps)
    host.load()
    owners: dict[str, list[int]] = {}
    for i, names in enumerate(plan):
        for n in names:
            owners.setdefault(n, []).append(i)
    assert host.transport_names() == tuple(sorted(owners))
    for name in ["a", "b", "c", "d"]:
        who = owners.get(name, [])
        if not who:
            with pytest.raises(PluginNotFoundError):
                host.transport_info(name)
        elif len(who) > 1:
            with pytest.raises(PluginConflictError) as exc_info:
                host.transport_info(name)
            for i in who:
                assert f"d{i} 1.0" in str(exc_info.value)
        else:
            assert host.transport_info(name).distribution == f"d{who[0]}"
    assert len(host.errors()) == sum(1 for w in owners.values() if len(w) > 1)


def test_capabilities_reach_the_caller_unchanged() -> None:
    caps = TransportCapabilities(
        memory_kinds={MemoryKind.HOST, MemoryKind.DEVICE},
        read=True,
        write=True,
        notifications=False,
        max_notification_bytes=0,
    )
    host = host_with()
    host.register(
        make_plugin(
            "caps",
            kvframe_register_transports=lambda register: register(
                "dev", FakeTransport.factory, capabilities=caps
            ),
        )
    )
    assert host.transport_info("dev").capabilities is caps
