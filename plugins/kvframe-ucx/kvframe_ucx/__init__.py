"""kvframe-ucx: the UCX (ucxx) transport plugin for kvframe.

The transport is :class:`kvframe_ucx.transport.UcxTransport`; its module docstring is the
capability card. kvframe finds this distribution through the ``kvframe`` entry-point group
(``ucx = "kvframe_ucx.plugin"``) and registers it under the name ``"ucx"``.
"""

from kvframe_ucx.transport import (
    CAPABILITIES,
    MAX_NOTIFICATION_BYTES,
    METADATA_VERSION,
    UcxOptions,
    UcxTransport,
)

__version__ = "0.1.0"

__all__ = [
    "CAPABILITIES",
    "MAX_NOTIFICATION_BYTES",
    "METADATA_VERSION",
    "UcxOptions",
    "UcxTransport",
    "__version__",
]
