"""kvframe's etcd discovery backend (see :mod:`kvframe_etcd.backend`)."""

from __future__ import annotations

from kvframe_etcd.backend import EtcdDiscovery

__all__ = ["EtcdDiscovery"]
