"""Two network namespaces joined by a veth pair, for tests that cut a link between processes.

Everything here is the test's own: two namespaces and one veth pair, named from the process id
and a counter (unique per test), with one address each on a /30 of ``10.213.0.0/16``. The
addresses exist only inside the two namespaces, so the traffic of a test never leaves them and
never meets another test's, whatever the other test picked. :meth:`VethPair.cut` sets one end
of the pair down (both directions stop at once: the other end loses its carrier),
:meth:`VethPair.heal` sets it up again and waits for the carrier. Processes run inside a
namespace through :meth:`VethPair.prefix` (``ip netns exec NAME ...``).

:meth:`VethPair.close` (also the context manager's exit) kills whatever still runs inside the
two namespaces and deletes them, the veth pair with them; it is safe twice and after a set-up
that failed halfway.

Network namespaces need root and iproute2 (CI has both). Where they are missing the tests
**fail** with :class:`NetnsUnavailable`, whose message says what to provide: a partition test
that skipped would pass silently on the very machines where nobody looks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from types import TracebackType

__all__ = ["NetnsUnavailable", "VethPair"]

_counter = itertools.count()


class NetnsUnavailable(AssertionError):
    """Network namespaces cannot be made here (no iproute2, or not root)."""


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class VethPair:
    """Namespaces ``ns_a`` and ``ns_b``, joined by veth ends ``dev_a`` / ``dev_b`` with
    addresses ``addr_a`` / ``addr_b``. Created in the constructor; raises
    :class:`NetnsUnavailable` where namespaces cannot be made (nothing is left behind)."""

    def __init__(self) -> None:
        pid, n = os.getpid(), next(_counter)
        # Interface names have at most 15 characters: "kv" + pid (<= 7 digits) + n + "a".
        self.ns_a, self.ns_b = f"kvframe-{pid}-{n}-a", f"kvframe-{pid}-{n}-b"
        self.dev_a, self.dev_b = f"kv{pid}{n}a", f"kv{pid}{n}b"
        index = (pid * 8 + n) % (256 * 64)  # one /30 out of 10.213.0.0/16
        base = (index % 64) * 4
        net = f"10.213.{index // 64}"
        self.addr_a, self.addr_b = f"{net}.{base + 1}", f"{net}.{base + 2}"
        self._made: list[str] = []
        self.cut_at: float | None = None
        self.healed_at: float | None = None
        if shutil.which("ip") is None:
            raise NetnsUnavailable(
                "the partition tests need iproute2's `ip` (apt-get install iproute2) and root; "
                "they fail instead of skipping"
            )
        try:
            self._create()
        except BaseException as exc:
            self.close()
            if isinstance(exc, RuntimeError):
                raise NetnsUnavailable(
                    f"cannot create network namespaces and a veth pair here ({exc}); the "
                    "partition tests need root (CAP_NET_ADMIN) and iproute2, and fail instead "
                    "of skipping"
                ) from exc
            raise

    def _create(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _ip("netns", "del", ns, check=False)  # a leftover of a killed run with this pid
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
        try:
            _ip("link", "set", self.dev_a, "netns", self.ns_a)
            _ip("link", "set", self.dev_b, "netns", self.ns_b)
        except RuntimeError:
            _ip("link", "del", self.dev_a, check=False)  # still in the caller's namespace
            raise
        sides = ((self.ns_a, self.dev_a, self.addr_a), (self.ns_b, self.dev_b, self.addr_b))
        for ns, dev, addr in sides:
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        # Static neighbours: ARP cannot fail during a cut and linger after the heal (a
        # neighbour entry left FAILED makes new connections fail with "No route to host"
        # for a while), so the link carries again the moment it is up.
        mac_a, mac_b = self._mac(self.ns_a, self.dev_a), self._mac(self.ns_b, self.dev_b)
        _ip("-n", self.ns_a, "neigh", "replace", self.addr_b, "lladdr", mac_b, "dev", self.dev_a,
            "nud", "permanent")  # fmt: skip
        _ip("-n", self.ns_b, "neigh", "replace", self.addr_a, "lladdr", mac_a, "dev", self.dev_b,
            "nud", "permanent")  # fmt: skip
        self._wait_carrier(5.0)

    @staticmethod
    def _mac(ns: str, dev: str) -> str:
        words = _ip("-n", ns, "link", "show", dev).stdout.split()
        return words[words.index("link/ether") + 1]

    def prefix(self, side: str) -> list[str]:
        """The command prefix that runs a program inside namespace ``side`` (``"a"``/``"b"``)."""
        return ["ip", "netns", "exec", self.ns_a if side == "a" else self.ns_b]

    def addr(self, side: str) -> str:
        """The address of side ``side`` (``"a"``/``"b"``)."""
        return self.addr_a if side == "a" else self.addr_b

    def cut(self) -> float:
        """Set ``dev_a`` down: nothing passes either way. Returns the time (monotonic)."""
        _ip("-n", self.ns_a, "link", "set", self.dev_a, "down")
        self.cut_at = time.monotonic()
        return self.cut_at

    def heal(self, timeout: float = 5.0) -> float:
        """Set ``dev_a`` up again and wait until both ends have their carrier. Returns the time
        (monotonic) the link carried again."""
        _ip("-n", self.ns_a, "link", "set", self.dev_a, "up")
        self._wait_carrier(timeout)
        self.healed_at = time.monotonic()
        return self.healed_at

    def _wait_carrier(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            up = all(
                "LOWER_UP" in _ip("-n", ns, "link", "show", dev).stdout
                for ns, dev in ((self.ns_a, self.dev_a), (self.ns_b, self.dev_b))
            )
            if up:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair {self.dev_a}/{self.dev_b} has no carrier")
            time.sleep(0.01)

    def close(self) -> None:
        """Kill what still runs inside the namespaces, then delete them (the veth pair goes
        with them). Never raises; safe twice."""
        for ns in self._made:
            with contextlib.suppress(Exception):
                pids = _ip("netns", "pids", ns, check=False).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
        for ns in self._made:
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> VethPair:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
