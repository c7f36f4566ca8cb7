"""A byte-level tokenizer: token ``b`` (0..255) is the byte ``b``.

The model's vocabulary is larger than 256 (it is random anyway); ids from 256 up have no text
and decode as ``<id>``, so any generated sequence prints.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["decode", "encode"]


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of ``text`` as token ids. Raises ``TypeError`` for a non-``str``."""
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}")
    return list(text.encode("utf-8"))


def decode(token_ids: Sequence[int]) -> str:
    """Text for ``token_ids``: runs of byte tokens decode as UTF-8 (invalid bytes become
    U+FFFD), every other id as ``<id>``. Never raises for ints."""
    out: list[str] = []
    run = bytearray()
    for t in token_ids:
        if 0 <= t < 256:
            run.append(t)
            continue
        if run:
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
        out.append(f"<{t}>")
    if run:
        out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)
