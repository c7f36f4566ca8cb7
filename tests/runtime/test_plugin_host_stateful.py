"""The host against a plain model: explicit registration is all-or-nothing, whatever the order.

Each step registers a plugin by code: a good one, one that clashes with what is registered, one
whose hook fails half-way, or one that calls ``register`` wrongly. The model is a dict of
name -> plugin; failed steps must leave the host exactly as the model says.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvframe.errors import PluginConflictError, PluginError, PluginNotFoundError
from kvframe.runtime.plugins import Kind, PluginHost, PluginStatus

from .fakes import CAPS, FakeTransport, make_plugin

NAMES = st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True, min_size=1, max_size=3)
KINDS = st.sampled_from([Kind.TRANSPORT, Kind.OFFLOAD_TIER])


def _plugin(kind: Kind, names: list[str], *, fail_after: int | None = None) -> Any:
    def register_all(register: Any) -> None:
        for i, n in enumerate(names):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("hook failed half-way")
            if kind is Kind.TRANSPORT:
                register(n, FakeTransport.factory, capabilities=CAPS)
            else:
                register(n, dict)

    return make_plugin("p", **{kind.hook: register_all})


class HostMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.host = PluginHost(env={}, entry_points=list, builtins=())
        self.host.load()
        self.model: dict[Kind, dict[str, str]] = {Kind.TRANSPORT: {}, Kind.OFFLOAD_TIER: {}}
        self.count = 0

    def _name(self) -> str:
        self.count += 1
        return f"plugin{self.count}"

    @rule(kind=KINDS, names=NAMES)
    def register_plugin(self, kind: Kind, names: list[str]) -> None:
        plugin_name = self._name()
        taken = [n for n in names if n in self.model[kind]]
        if taken:
            with pytest.raises(PluginConflictError, match=repr(taken[0])):
                self.host.register(_plugin(kind, names), name=plugin_name)
            return
        info = self.host.register(_plugin(kind, names), name=plugin_name)
        assert info.status is PluginStatus.LOADED
        for n in names:
            self.model[kind][n] = plugin_name

    @rule(kind=KINDS, names=NAMES, data=st.data())
    def register_plugin_that_fails_half_way(self, kind: Kind, names: list[str], data: Any) -> None:
        fail_after = data.draw(st.integers(0, len(names) - 1))
        with pytest.raises(PluginError) as exc_info:
            self.host.register(_plugin(kind, names, fail_after=fail_after), name=self._name())
        # Reported as the hook's failure, never as a clash: hooks run to completion first.
        assert not isinstance(exc_info.value, PluginConflictError)
        assert isinstance(exc_info.value.__cause__, RuntimeError)

    @rule(names=NAMES)
    def register_plugin_with_bad_arguments(self, names: list[str]) -> None:
        def bad(register: Any) -> None:
            for n in names:
                register(n, FakeTransport.factory, capabilities=CAPS)
            register("ok-name", FakeTransport.factory)  # capabilities missing

        # The bad call comes after good ones that may clash: the plugin is refused for the bad
        # call (hooks run to completion before clashes are checked), and none of its names stay.
        with pytest.raises(PluginError, match="called register wrongly") as exc_info:
            self.host.register(make_plugin("bad", kvframe_register_transports=bad), name="bad")
        assert not isinstance(exc_info.value, PluginConflictError)

    @invariant()
    def names_match_the_model(self) -> None:
        for kind, names in self.model.items():
            assert self.host.names(kind) == tuple(sorted(names))

    @invariant()
    def every_name_resolves_to_its_plugin(self) -> None:
        for name, plugin in self.model[Kind.TRANSPORT].items():
            assert self.host.transport_info(name).plugin == plugin
        for name, plugin in self.model[Kind.OFFLOAD_TIER].items():
            assert self.host.offload_tier_info(name).plugin == plugin

    @invariant()
    def failed_explicit_registrations_leave_no_trace(self) -> None:
        assert self.host.errors() == ()
        # Every successful plugin registered at least one name, so the model knows them all.
        owners = {p for names in self.model.values() for p in names.values()}
        assert {p.name for p in self.host.plugins()} == owners
        assert all(p.status is PluginStatus.LOADED for p in self.host.plugins())

    @invariant()
    def unregistered_names_are_not_found(self) -> None:
        for n in ["a", "b", "c", "d", "e"]:
            if n not in self.model[Kind.TRANSPORT]:
                with pytest.raises(PluginNotFoundError):
                    self.host.transport_info(n)


TestHostMachine = HostMachine.TestCase
