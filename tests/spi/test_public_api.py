"""The public surface of the SPI, configuration and protocol modules: explicit and documented."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "kvframe.config",
    "kvframe.spi.connector",
    "kvframe.spi.request",
    "kvframe.protocol",
    "kvframe.protocol.aggregate",
    "kvframe.protocol.codec",
    "kvframe.protocol.messages",
]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_exists_and_is_documented(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__
    assert isinstance(module.__all__, list)
    assert len(set(module.__all__)) == len(module.__all__)
    for public in module.__all__:
        obj = getattr(module, public)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"{name}.{public} has no docstring"
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                func = member.__func__ if isinstance(member, classmethod) else member
                if inspect.isfunction(func) or isinstance(func, property):
                    assert inspect.getdoc(func), f"{name}.{public}.{attr} has no docstring"


def test_the_plugin_host_finds_the_names_it_registers() -> None:
    from kvframe.spi import connector

    assert {"KVConnector", "KVConnectorScheduler", "KVConnectorWorker"} <= set(connector.__all__)
