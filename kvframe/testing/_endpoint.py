"""Child process of :class:`kvframe.testing.endpoint.ChildEndpoint`.

Run as ``python -m kvframe.testing._endpoint FD`` where ``FD`` is an inherited socket; the
commands arrive on it as length-prefixed codec messages (see :mod:`kvframe.testing._wire`).
"""

from __future__ import annotations

import sys

from kvframe.testing.endpoint import serve_child

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Serve the inherited socket named by the only argument; returns the exit status."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m kvframe.testing._endpoint FD", file=sys.stderr)
        return 2
    serve_child(int(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
