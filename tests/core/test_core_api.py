"""The core's public surface: explicit ``__all__`` everywhere, a docstring on every public name."""

from __future__ import annotations

import importlib
import inspect

import pytest

import kvframe.core

MODULES = [
    "kvframe.core",
    "kvframe.core.lease",
    "kvframe.core.heartbeat",
    "kvframe.core.clock",
    "kvframe.core.wire",
    "kvframe.core.tp",
    "kvframe.core.blocksize",
    "kvframe.core._checks",
    "kvframe.bench.lease",
]


@pytest.mark.parametrize("name", MODULES)
def test_module_has_docstring_and_explicit_all(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    assert isinstance(module.__all__, list)
    assert len(set(module.__all__)) == len(module.__all__)
    for public in module.__all__:
        obj = getattr(module, public)
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj):
            assert obj.__doc__, f"{name}.{public} has no docstring"
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member):
                    continue
                assert member.__doc__, f"{name}.{public}.{attr} has no docstring"


def test_package_reexports_the_public_names() -> None:
    from kvframe.core import clock, heartbeat, lease

    for public in kvframe.core.__all__:
        assert hasattr(kvframe.core, public)
    for module in (lease, heartbeat, clock):
        for public in module.__all__:
            if public in kvframe.core.__all__:
                assert getattr(kvframe.core, public) is getattr(module, public)
