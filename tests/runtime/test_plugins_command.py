"""``kvframe plugins``: run through ``kvframe.cli.main`` with faked entry points."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import pytest

from kvframe.cli import main
from kvframe.runtime.plugins import BUILTIN_PLUGINS, ENV_BLOCK_PLUGINS, ENV_DISABLE_PLUGIN_AUTOLOAD

from .fakes import CAPS as FAKE_CAPS
from .fakes import FakeConnector, FakeTransport, ep, make_plugin, transport_plugin


def _tier(config: Any) -> Any:
    return config


def _policy(config: Any) -> Any:
    return config


def _everything() -> Any:
    return make_plugin(
        "everything",
        kvframe_register_transports=lambda register: register(
            "fake-fast", FakeTransport.factory, capabilities=FAKE_CAPS
        ),
        kvframe_register_connectors=lambda register: register("fake-conn", FakeConnector),
        kvframe_register_offload_tiers=lambda register: register("fake-tier", _tier),
        kvframe_register_eviction_policies=lambda register: register("fake-policy", _policy),
    )


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The entry points ``importlib.metadata`` reports; the process env is cleaned."""
    eps: list[Any] = [ep("everything", _everything(), dist="kvframe-everything", version="3.1")]

    def fake_entry_points(**kwargs: Any) -> list[Any]:
        assert kwargs == {"group": "kvframe"}
        return eps

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.delenv(ENV_DISABLE_PLUGIN_AUTOLOAD, raising=False)
    monkeypatch.delenv(ENV_BLOCK_PLUGINS, raising=False)
    return eps


def test_text_report_lists_plugins_kinds_and_capabilities(
    installed: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for needle in (
        "entry-point autoload: on",
        "inprocess  [loaded, builtin]  kvframe 0.1.0",
        "everything  [loaded, entry-point]  kvframe-everything 3.1",
        "transports: fake-fast",
        "fake-fast  (from everything)",
        "memory host; read; notifications up to 512 B; cross-process",
        "in-process only",  # the built-in transport
        "fake-conn  (from everything)",
        "PDConnector  (from pd)",
        f"{FakeConnector.__module__}.FakeConnector",
        "fake-tier  (from everything)",
        "fake-policy  (from everything)",
        "errors: none",
    ):
        assert needle in out, f"{needle!r} missing from:\n{out}"


def test_json_report(installed: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["autoload"] is True
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["everything"]["version"] == "3.1"
    assert by_name["everything"]["offload_tiers"] == ["fake-tier"]
    assert by_name["inprocess"]["source"] == "builtin"
    fast = next(t for t in data["transports"] if t["name"] == "fake-fast")
    assert fast["capabilities"] == {
        "memory_kinds": ["host"],
        "read": True,
        "write": False,
        "notifications": True,
        "max_notification_bytes": 512,
        "cross_process": True,
        "ordered_notifications": True,
    }
    assert fast["distribution"] == "kvframe-everything"
    connectors = {c["name"]: c for c in data["connectors"]}
    assert connectors["fake-conn"]["plugin"] == "everything"
    assert connectors["PDConnector"]["distribution"] == "kvframe"
    policies = {c["name"]: c for c in data["eviction_policies"]}
    assert policies["fake-policy"]["object"].endswith("._policy")
    assert data["errors"] == []


def test_load_errors_and_clashes_are_printed_and_exit_1(
    installed: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    installed.append(ep("broken", ImportError("no module named x"), dist="kvframe-broken"))
    installed.append(
        ep("rival", transport_plugin("fake-fast"), dist="kvframe-rival", version="0.2")
    )
    assert main(["plugins"]) == 1
    out = capsys.readouterr().out
    assert "broken  [failed, entry-point]  kvframe-broken 1.0" in out
    assert "errors (2):" in out
    assert "ImportError: no module named x" in out
    assert "fake-fast  (from rival)  AMBIGUOUS" in out
    assert "kvframe-rival 0.2" in out
    assert main(["plugins", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert len(data["errors"]) == 2
    assert {t["plugin"] for t in data["transports"] if t["conflict"]} == {"everything", "rival"}


def test_env_switches_show_in_the_report(
    installed: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_BLOCK_PLUGINS, "everything,nosuchplugin")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "blocked (KVFRAME_BLOCK_PLUGINS): everything, nosuchplugin" in out
    assert "matched no plugin: nosuchplugin" in out
    assert "everything  [blocked, entry-point]" in out
    monkeypatch.setenv(ENV_DISABLE_PLUGIN_AUTOLOAD, "1")
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["autoload"] is False
    assert [p["name"] for p in data["plugins"]] == [name for name, _ in BUILTIN_PLUGINS]


def test_bad_env_value_exits_2_with_a_message(
    installed: list[Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV_DISABLE_PLUGIN_AUTOLOAD, "perhaps")
    assert main(["plugins"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "KVFRAME_DISABLE_PLUGIN_AUTOLOAD='perhaps' is not understood" in captured.err
