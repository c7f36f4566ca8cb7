"""RequestView and chained block hashes."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.spi.request import (
    BLOCK_HASH_SIZE,
    RequestView,
    block_hashes,
    next_block_hash,
    root_block_hash,
)

tokens = st.lists(st.integers(0, 2**17), max_size=40)


def test_hash_is_sha256_over_parent_and_little_endian_u64_tokens() -> None:
    root = root_block_hash()
    assert root == hashlib.sha256(b"kvframe.block_hash.v1\x00").digest()
    expected = hashlib.sha256(root + struct.pack("<3Q", 1, 2, 2**40)).digest()
    assert next_block_hash(root, [1, 2, 2**40]) == expected
    assert block_hashes([1, 2, 2**40, 9], 3) == (expected,)


def test_hashes_are_identical_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from kvframe.spi.request import block_hashes;"
        "print(b''.join(block_hashes(list(range(100)), 16, salt=b'lora')).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here = b"".join(block_hashes(list(range(100)), 16, salt=b"lora")).hex()
    assert out.stdout.strip() == here


@given(tokens, tokens, st.integers(1, 8))
def test_equal_hashes_exactly_when_equal_full_block_prefixes(
    a: list[int], b: list[int], size: int
) -> None:
    ha, hb = block_hashes(a, size), block_hashes(b, size)
    assert len(ha) == len(a) // size
    assert all(len(h) == BLOCK_HASH_SIZE for h in ha)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * size] == b[: (i + 1) * size]
        assert (ha[i] == hb[i]) == same_prefix


@given(tokens, st.integers(1, 8))
def test_hashes_extend_incrementally(a: list[int], size: int) -> None:
    full = block_hashes(a, size)
    parent = root_block_hash()
    for i, h in enumerate(full):
        parent = next_block_hash(parent, a[i * size : (i + 1) * size])
        assert parent == h


def test_salt_separates_caches() -> None:
    assert block_hashes([1, 2], 2) != block_hashes([1, 2], 2, salt=b"adapter-7")


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: block_hashes([1], 0), "block_size = 0"),
        (lambda: block_hashes([1, -1], 2), r"token_ids\[1\] = -1"),
        (lambda: block_hashes([1, 2**64], 2), r"token_ids\[1\]"),
        (lambda: block_hashes([True], 1), "token_ids"),
        (lambda: next_block_hash(b"short", [1]), "parent hash must be 32 bytes"),
    ],
)
def test_bad_hash_input(call: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()  # type: ignore[operator]


def test_root_salt_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="salt must be bytes"):
        root_block_hash("x")  # type: ignore[arg-type]


def test_request_view_is_frozen_and_copies_params() -> None:
    params = {"do_remote_decode": True}
    view = RequestView(
        request_id="r1",
        num_prompt_tokens=5,
        block_ids=[[1, 2]],
        block_hashes=block_hashes([1, 2, 3, 4], 2),
        kv_transfer_params=params,
        arrival_time=1.5,
    )
    params["do_remote_decode"] = False
    assert view.kv_transfer_params == {"do_remote_decode": True}
    assert view.block_ids == ((1, 2),)
    with pytest.raises(TypeError):
        view.kv_transfer_params["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        view.num_computed_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"request_id": ""}, "request_id"),
        ({"num_prompt_tokens": -1}, "num_prompt_tokens"),
        ({"num_computed_tokens": 1.0}, "num_computed_tokens"),
        ({"block_hashes": [b"x"]}, r"block_hashes\[0\]"),
        ({"block_ids": [[0, -1]]}, r"block_ids\[0\] contains -1"),
        ({"arrival_time": float("nan")}, "arrival_time"),
    ],
)
def test_request_view_validation(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"request_id": "r", "num_prompt_tokens": 1, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        RequestView(**args)  # type: ignore[arg-type]


def test_request_view_rejects_non_mapping_params() -> None:
    with pytest.raises(TypeError, match="kv_transfer_params"):
        RequestView(request_id="r", num_prompt_tokens=1, kv_transfer_params=[1])  # type: ignore[arg-type]
