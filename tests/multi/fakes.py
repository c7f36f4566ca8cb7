"""A worker half that moves nothing, for MultiConnector tests."""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

from kvframe.spi.connector import KVConnectorWorker


class NullWorker(KVConnectorWorker):
    """Moves nothing; reports in ``get_finished`` what a test put in ``sending``/``recving``."""

    def __init__(self) -> None:
        self.recving: set[str] = set()
        self.sending: set[str] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        pass

    def start_load_kv(self, forward_context: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        s, r = self.sending, self.recving
        self.sending, self.recving = set(), set()
        return s or None, r or None
