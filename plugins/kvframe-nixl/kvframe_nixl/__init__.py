"""kvframe-nixl: the NIXL transport plugin for kvframe.

The transport is :class:`kvframe_nixl.transport.NixlTransport`; its module docstring is the
capability card. kvframe finds this distribution through the ``kvframe`` entry-point group
(``nixl = "kvframe_nixl.plugin"``) and registers it under the name ``"nixl"``.
"""

from kvframe_nixl.transport import (
    CAPABILITIES,
    MAX_NOTIFICATION_BYTES,
    METADATA_VERSION,
    NixlOptions,
    NixlTransport,
)

__version__ = "0.1.0"

__all__ = [
    "CAPABILITIES",
    "MAX_NOTIFICATION_BYTES",
    "METADATA_VERSION",
    "NixlOptions",
    "NixlTransport",
    "__version__",
]
