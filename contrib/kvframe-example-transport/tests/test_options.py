from __future__ import annotations

import pytest
from kvframe_example_transport import TcpTransport

from kvframe.errors import ConfigError
from kvframe.spi.transport import TransportParams


@pytest.mark.parametrize(
    ("options", "key"),
    [({"colour": "red"}, "colour"), ({"host": 1}, "host"), ({"connect_timeout": 0}, "timeout")],
)
def test_bad_options_are_named(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TcpTransport(TransportParams(name="x", options=options))
