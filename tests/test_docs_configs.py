"""Every JSON configuration in ``docs/*.md`` parses and builds.

A ``json`` block is a kvframe configuration (what ``KVTransferConfig.from_dict`` reads), or a
vLLM ``--kv-transfer-config`` when its ``kv_connector`` is ``KVFrameConnector``; so is the
single-quoted JSON after ``--kv-transfer-config`` in a ``bash`` block. A kvframe one is parsed,
then its connector is looked up in a loaded plugin host and both halves are built as an engine
builds them (the scheduler, and the worker of rank 0 with its transport), then shut down. The
vLLM ones need ``kvframe_vllm``, so ``tests_vllm/test_adapter_config.py`` parses and builds
them with :func:`vllm_examples`; here they are only counted, so that a block of neither kind
fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvframe.config import KVTransferConfig
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo

DOCS = Path(__file__).resolve().parent.parent / "docs"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_VLLM_ARG = re.compile(r"--kv-transfer-config\s+'(.*?)'", re.S)
VLLM_CONNECTOR = "KVFrameConnector"


def _blocks() -> Iterator[tuple[str, str, str]]:
    """(where, kind, JSON text) of every configuration on every page."""
    for page in sorted(DOCS.glob("*.md")):
        for n, (lang, body) in enumerate(_FENCE.findall(page.read_text())):
            where = f"docs/{page.name}, block {n}"
            if lang == "json":
                yield where, "json", body
            elif lang == "bash":
                for m in _VLLM_ARG.finditer(body):
                    yield where, "vllm-arg", m.group(1).replace("\\\n", "\n")


def _parsed() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for where, _kind, text in _blocks():
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:  # reported by the test below, with its place
            data = {"_invalid": f"{exc}"}
        out.append((where, data))
    return out


def kvframe_examples() -> list[tuple[str, dict[str, Any]]]:
    """The kvframe configurations in the docs: ``(where, data)``."""
    return [(w, d) for w, d in _parsed() if d.get("kv_connector") != VLLM_CONNECTOR]


def vllm_examples() -> list[tuple[str, dict[str, Any]]]:
    """The vLLM ``--kv-transfer-config`` objects in the docs: ``(where, data)``."""
    return [(w, d) for w, d in _parsed() if d.get("kv_connector") == VLLM_CONNECTOR]


def build_halves(config: KVTransferConfig, host: PluginHost | None = None) -> list[str]:
    """Build ``config``'s connector as an engine would (scheduler, worker of rank 0), shut both
    down, and return the classes built (for the test's message)."""
    if host is None:
        host = PluginHost()
        host.load()
    cls = host.connector(config.kv_connector)
    ctx = BuildContext(host=host)
    info = EngineInfo(block_size=16, model="docs-model")
    scheduler = cls.build_scheduler(config, info, ctx)
    try:
        worker = cls.build_worker(config, info, 0, ctx)
        worker.shutdown()
    finally:
        scheduler.shutdown()
    return [type(scheduler).__name__, type(worker).__name__]


def _local_paths(data: Any, root: Path) -> Any:
    # A disk tier's path in an example is the operator's (/var/cache/...): built here in a
    # temporary directory instead, so the test writes nowhere else.
    if isinstance(data, dict):
        return {
            k: str(root / Path(v).name)
            if k == "path" and isinstance(v, str)
            else _local_paths(v, root)
            for k, v in data.items()
        }
    if isinstance(data, list):
        return [_local_paths(v, root) for v in data]
    return data


def test_the_docs_hold_configurations_of_both_kinds() -> None:
    # The pages this test is for: a regex that stopped matching would pass vacuously.
    assert len(kvframe_examples()) >= 5
    assert len(vllm_examples()) >= 4
    pages = {w.split(",")[0] for w, _ in kvframe_examples()}
    assert {"docs/configuration.md", "docs/multi.md", "docs/offloading.md"} <= pages


@pytest.mark.parametrize(
    ("where", "data"), kvframe_examples(), ids=[w for w, _ in kvframe_examples()]
)
def test_a_kvframe_example_parses_and_builds(
    where: str, data: dict[str, Any], tmp_path: Path
) -> None:
    assert "_invalid" not in data, f"{where}: not valid JSON: {data.get('_invalid')}"
    config = KVTransferConfig.from_dict(_local_paths(data, tmp_path))
    assert KVTransferConfig.from_dict(config.to_dict()) == config
    built = build_halves(config)
    assert len(built) == 2, where
