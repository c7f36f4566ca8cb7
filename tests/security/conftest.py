"""Fixtures of the attack tests: the attacker process and the single-engine reference (the
fleets are module-scoped, one per module: with and without the fleet key)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("nixl_cu12", reason="the attacks run over NIXL")
pytest.importorskip("kvframe_refengine", reason="the attacks run against the reference engine")

from tests.security.attacker import Attacker
from tests.security.fleet import CLIENT, OTHER, POISONED, VICTIM, reference

#: The prompts the tests send as real clients, and the one the flood's client repeats.
CLIENT_PROMPTS = [VICTIM, OTHER, POISONED, CLIENT]


@pytest.fixture(scope="session")
def expected() -> dict[tuple[int, ...], list[int]]:
    """Each client prompt's greedy output on one engine without P/D."""
    outs = reference(CLIENT_PROMPTS)
    return {tuple(p): o for p, o in zip(CLIENT_PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def attacker() -> Iterator[Attacker]:
    a = Attacker()
    try:
        yield a
    finally:
        a.close()
