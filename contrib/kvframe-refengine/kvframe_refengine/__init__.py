"""kvframe's reference engine: a tiny real LLM engine that embeds kvframe.

It exists to show engine developers how to embed kvframe's connector SPI, and to prove the whole
prefill/decode path on real model math. Read it in this order: :mod:`.engine` (the API),
:mod:`.scheduler` (where the connector's scheduler half is called), :mod:`.runner` (where the
worker half is called), :mod:`.model` and :mod:`.block_pool`.
"""

from kvframe_refengine.block_pool import BlockPool, OutOfBlocksError
from kvframe_refengine.engine import Engine, EngineConfig, LeakError
from kvframe_refengine.model import ModelConfig, TinyLM, greedy_reference
from kvframe_refengine.request import FinishReason, RequestOutput, RequestStatus

__all__ = [
    "BlockPool",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "LeakError",
    "ModelConfig",
    "OutOfBlocksError",
    "RequestOutput",
    "RequestStatus",
    "TinyLM",
    "greedy_reference",
]
