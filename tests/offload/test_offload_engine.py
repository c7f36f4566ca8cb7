"""The offloading connector on the reference engine: CPU tier, restart from disk, failures."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvframe_refengine import Engine, EngineConfig

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import OffloadingConnector
from kvframe.connectors.offload.tiers import DiskTier
from kvframe.errors import ConfigError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.offload import CorruptEntryError, TierConfig

PROMPT = [(i * 7 + 3) % 250 + 1 for i in range(80)]  # 5 full blocks of 16
BLOCK_KV = 2 * 16 * 2 * 32 * 4  # K/V × tokens × kv heads × head dim × fp32, per layer


def _config(
    tmp: Path | None, cpu: int = 1 << 20, connector: str = "OffloadingConnector"
) -> KVTransferConfig:
    tiers: list[dict[str, Any]] = [{"tier": "cpu", "capacity_bytes": cpu}]
    if tmp is not None:
        tiers.append({"tier": "disk", "capacity_bytes": 1 << 22, "path": str(tmp)})
    return KVTransferConfig.from_dict(
        {
            "kv_connector": connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": tiers, "eviction_policy": "arc"},
        }
    )


def _engine(kv: KVTransferConfig, host: PluginHost | None = None) -> Engine:
    # No local prefix cache: a second identical prompt can only be served by the connector.
    cfg = EngineConfig(torch_threads=1, num_blocks=48, enable_prefix_caching=False)
    return Engine(cfg, kv, plugin_host=host)


def _run(engine: Engine, prompt: list[int]) -> tuple[tuple[int, ...], int, int]:
    before = engine.scheduler.counters["tokens_computed"]
    out = engine.generate([prompt], max_tokens=4)[0]
    engine.run_until_idle()
    computed = engine.scheduler.counters["tokens_computed"] - before
    return out.token_ids, out.num_external_tokens, computed


def test_second_time_from_cpu_then_after_restart_from_disk(tmp_path: Path) -> None:
    kv = _config(tmp_path)
    with _engine(kv) as e1:
        first, ext1, computed1 = _run(e1, PROMPT)
        second, ext2, computed2 = _run(e1, PROMPT)
        e1.check_no_leaks()
        assert ext1 == 0
        assert second == first
        assert ext2 == 64  # 4 blocks: the 5th holds the last prompt token, computed locally
        assert computed2 < computed1
        assert e1.connector_worker is not None
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) >= 5  # written through to disk in the background
    with _engine(kv) as e2:  # a restart: empty CPU tier, same directory
        third, ext3, computed3 = _run(e2, PROMPT)
        assert third == first
        assert ext3 == 64  # promoted from disk to CPU, then loaded layer by layer
        assert computed3 == computed2
        e2.check_no_leaks()


def test_corrupt_and_truncated_disk_entries_are_misses_and_removed(tmp_path: Path) -> None:
    kv = _config(tmp_path)
    with _engine(kv) as e1:
        first, _, computed1 = _run(e1, PROMPT)
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    # Corrupt every entry: flip a payload byte in some, truncate the others.
    for i, f in enumerate(files):
        data = bytearray(f.read_bytes())
        if i % 2:
            data[-1] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))
    with _engine(kv) as e2:
        again, ext, computed = _run(e2, PROMPT)
        assert again == first
        assert ext == 0
        assert computed == computed1
        e2.check_no_leaks()
        events = e2.take_events()
        assert any(ev.kind == "offload.removed" and ev.data["reason"] == "corrupt" for ev in events)
    # The bad files were removed, and the request's blocks were stored again, intact.
    with _engine(kv) as e3:
        _, ext3, _ = _run(e3, PROMPT)
        assert ext3 == 64


class _FullDisk(DiskTier):
    """A disk tier whose device is full: every write fails with ENOSPC."""

    def _pwrite(self, fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FaultPlugin:
    @staticmethod
    @hookimpl
    def kvframe_register_offload_tiers(register: Any) -> None:
        register("fulldisk", _FullDisk)


# The engine builds the offloading connector with this host in its BuildContext, so the
# connector finds the tier registered here by code.
_HOST = PluginHost(env={}, entry_points=list)
_HOST.load()
_HOST.register(_FaultPlugin(), "faults")


def test_full_disk_degrades_to_cpu_only_with_a_warning(tmp_path: Path) -> None:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [
                    {"tier": "cpu", "capacity_bytes": 1 << 20},
                    {"tier": "fulldisk", "capacity_bytes": 1 << 22, "path": str(tmp_path)},
                ]
            },
        }
    )
    with _engine(kv, _HOST) as e:
        first, _, _ = _run(e, PROMPT)
        events = e.take_events()
        assert [ev.data["tier"] for ev in events if ev.kind == "offload.tier_disabled"] == [1]
        again, ext, _ = _run(e, PROMPT)  # still served from the CPU tier
        assert (again, ext) == (first, 64)
        e.check_no_leaks()
    assert not list(tmp_path.rglob("*.kvb"))
    assert not list(tmp_path.rglob("*.tmp"))


def test_disk_tier_detects_damage_and_removes_the_file(tmp_path: Path) -> None:
    tier = DiskTier(
        TierConfig(
            name="disk",
            index=1,
            capacity_bytes=1 << 16,
            block_bytes=256,
            options={"path": str(tmp_path)},
        )
    )
    tier.open()
    key = bytes(range(32))
    data = np.arange(256, dtype=np.uint8)
    tier.write(key, 0, data)
    out = np.zeros(256, dtype=np.uint8)
    tier.read(key, 0, out)
    assert np.array_equal(out, data)
    assert list(tier.scan()) == [key]
    path = tier.file_of(key)
    raw = bytearray(path.read_bytes())
    raw[256 + 20] ^= 1  # inside the trailer's key (trailer bytes 8..39, behind the payload)
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptEntryError, match="another key"):
        tier.read(key, 0, out)
    assert not path.exists()
    with pytest.raises(CorruptEntryError, match="gone"):
        tier.read(key, 0, out)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({}, "tiers: got None"),
        ({"tiers": [{"tier": "cpu", "capacity_bytes": -1}]}, r"tiers\[0\].capacity_bytes: got -1"),
        ({"tiers": [{"tier": "cpu", "capacity_bytes": "4GiB"}]}, "plain integers"),
        ({"tiers": [{"tier": "tape", "capacity_bytes": 10}]}, r"tiers\[0\].tier: .*tape"),
        (
            {"tiers": [{"tier": "cpu", "capacity_bytes": 10}], "eviction_policy": "mru"},
            "eviction_policy",
        ),
        (
            {"tiers": [{"tier": "cpu", "capacity_bytes": 10}], "io_thread": 2},
            "did you mean 'io_threads'",
        ),
        (
            {"tiers": [{"tier": "cpu", "capacity_bytes": 10, "path": "/x"}]},
            r"tiers\[0\].path: unknown option",
        ),
        (
            {"tiers": [{"tier": "cpu", "capacity_bytes": 100}]},
            r"tiers\[0\].capacity_bytes: got 100; expected at least one block",
        ),
        (
            {"tiers": [{"tier": "disk", "capacity_bytes": 1 << 20, "path": "/tmp/x"}]},
            "first tier must be a memory tier",
        ),
        (
            {
                "tiers": [
                    {"tier": "cpu", "capacity_bytes": 1 << 20},
                    {"tier": "disk", "capacity_bytes": 1 << 20},
                ]
            },
            r"tiers\[1\].path",
        ),
    ],
)
def test_bad_configuration_names_the_key(extra: dict[str, Any], message: str) -> None:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    )
    with pytest.raises(ConfigError, match=message):
        _engine(kv)


def test_offload_keys_are_deterministic_across_processes() -> None:
    import subprocess
    import sys

    code = (
        "from kvframe.spi.offload import offload_key;"
        "from kvframe.spi.request import block_hashes;"
        "print(offload_key(block_hashes(list(range(32)), 16)[1], b'ns').hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(outs) == 1


def test_failed_store_is_a_miss_and_its_room_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvframe.connectors.offload.worker import OffloadingWorker

    def broken(self: Any, name: str, job: Any) -> None:
        raise RuntimeError("copy-out failed")

    monkeypatch.setattr(OffloadingWorker, "_store_layer", broken)
    with _engine(_config(None)) as e:
        first, _, computed1 = _run(e, PROMPT)
        sched = e.connector_scheduler
        assert sched is not None
        manager = sched.manager  # type: ignore[attr-defined]
        assert manager.tier_usage(0) == (0, manager.tier_usage(0)[1])
        again, ext, computed2 = _run(e, PROMPT)
        assert (again, ext, computed2) == (first, 0, computed1)
        e.check_no_leaks()  # the blocks kept for the copy-out were released anyway


def test_failed_load_is_recomputed_with_equal_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvframe.connectors.offload.worker import OffloadingWorker

    with _engine(_config(None)) as e:
        first, _, _ = _run(e, PROMPT)
        real = OffloadingWorker._load_layer

        def flaky(self: Any, name: str, loads: Any) -> None:
            real(self, name, loads)
            if name == "layers.2":
                raise RuntimeError("copy-in failed")

        monkeypatch.setattr(OffloadingWorker, "_load_layer", flaky)
        again, _, _ = _run(e, PROMPT)
        assert again == first
        assert e.scheduler.counters["load_failures"] == 1
        e.check_no_leaks()


def test_requires_piecewise_for_per_layer_loads() -> None:
    from kvframe.connectors.multi import MultiConnector

    ctx = BuildContext(host=_HOST)
    assert OffloadingConnector.requires_piecewise_for_cudagraph({}, ctx) is True
    pd_only = {"connectors": [{"kv_connector": "PDConnector", "kv_role": "kv_consumer"}]}
    assert MultiConnector.requires_piecewise_for_cudagraph(pd_only, ctx) is False
    both = {"connectors": [*pd_only["connectors"], {"kv_connector": "OffloadingConnector"}]}
    assert MultiConnector.requires_piecewise_for_cudagraph(both, ctx) is True
