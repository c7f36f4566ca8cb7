"""The connectors kvframe ships, each registered as a built-in plugin:

- :mod:`kvframe.connectors.pd` — ``PDConnector``: prefill/decode disaggregation under leases.
- :mod:`kvframe.connectors.multi` — ``MultiConnector``: several connectors as one.
- :mod:`kvframe.connectors.offload` — ``OffloadingConnector``: KV kept in CPU and disk tiers.
"""

__all__: list[str] = []
