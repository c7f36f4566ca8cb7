"""Authentication of the P/D connector: a fleet key, signed tickets, the side channel's
challenge-response and tagged notifications.

Every engine of a fleet is given the same **key file**
(``kv_connector_extra_config.auth_key_file``).
With it:

- **Tickets.** What P returns in ``kv_transfer_params`` carries ``kvframe_ticket``: an
  HMAC-SHA256 (:mod:`hmac`, :mod:`hashlib`) over every other field in a canonical form
  (:func:`ticket_body`). D verifies it before it connects to P or reads a byte, and builds its
  transfer only from the verified fields, so a client of D's API cannot make D read blocks P did
  not grant for that request.
- **The side channel** (:mod:`kvframe.connectors.pd.handshake`) is mutually authenticated by
  challenge-response before P reveals its memory regions or transport metadata: D sends a
  fresh nonce, P answers with its own nonce and a proof over both (P knows the key), D answers
  with its request and a proof over both nonces and the request (D knows the key). Both derive
  a per-connection **session key** from the nonces (:func:`session_key`).
- **Notifications** (heartbeats, acks, loss and done notices) carry :data:`TAG_BYTES` bytes of
  HMAC-SHA256 under the session key (:func:`tag`, :func:`untag`): a notification from anyone
  but the peer that completed the handshake is dropped, so it can neither keep a lease alive
  nor end one.

Why HMAC with a shared key and not CurveZMQ: the one secret an operator must distribute is the
same for tickets, the side channel and notifications (a CurveZMQ channel would still need a
shared MAC key for the tickets that travel through the router), the standard library has it,
and a challenge-response costs two HMACs per side (a few microseconds, see ``docs/security.md``).
The side channel is authenticated, not encrypted: what it carries (memory addresses, transport
addresses, block layout) is of no use without the key, which gates every use of it.

**Key file.** One key per line, ``KEY_ID SECRET`` with ``SECRET`` in hex, at least
:data:`MIN_KEY_BYTES` bytes; ``#`` starts a comment. The first key signs and proves; every key
listed verifies. Rotation: add the new key on a second line everywhere, then move it first
everywhere, then drop the old one. ``kvframe keygen PATH`` writes a new file.

Without a key everything works as before, unauthenticated, and the connector logs a warning
once per process saying so (``docs/security.md`` says what that exposes).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvframe.errors import ConfigError

__all__ = [
    "MIN_KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "TICKET_FIELD",
    "KeyRing",
    "session_key",
    "tag",
    "ticket_body",
    "untag",
    "warn_unauthenticated",
]

#: The shortest secret accepted (bytes).
MIN_KEY_BYTES = 32
#: The bytes of a handshake nonce.
NONCE_BYTES = 16
#: The bytes of HMAC-SHA256 a notification carries.
TAG_BYTES = 8
#: The ``kv_transfer_params`` field that holds the ticket's signature.
TICKET_FIELD = "kvframe_ticket"

_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,16}")
_MAX_KEY_FILE = 64 * 1024
_log = logging.getLogger("kvframe.auth")
_warned = False


def _mac(key: bytes, *parts: bytes) -> bytes:
    # Length-prefixed parts: no two different part lists give the same input.
    data = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.digest(key, data, hashlib.sha256)


@attrs.frozen(repr=False)
class KeyRing:
    """The fleet's keys: the first signs, every one verifies. Never printed (its ``repr`` names
    the key ids only)."""

    keys: tuple[tuple[str, bytes], ...]

    def __attrs_post_init__(self) -> None:
        if not self.keys:
            raise ConfigError("a key ring needs at least one key")
        ids = [k for k, _ in self.keys]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"key ids must be distinct; got {ids}")

    def __repr__(self) -> str:
        return f"KeyRing(ids={[k for k, _ in self.keys]})"

    @property
    def signing_id(self) -> str:
        """The id of the key that signs (the first)."""
        return self.keys[0][0]

    def key(self, key_id: str) -> bytes | None:
        """The secret named ``key_id``, or ``None`` when this ring does not hold it."""
        for kid, secret in self.keys:
            if kid == key_id:
                return secret
        return None

    @classmethod
    def parse(cls, text: str, source: str = "the key file") -> KeyRing:
        """Keys from the text of a key file (see the module docs for the format). Raises
        :class:`~kvframe.errors.ConfigError` naming the line that is wrong (never its secret)."""
        keys: list[tuple[str, bytes]] = []
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(
                    f"{source}, line {n}: expected 'KEY_ID SECRET_HEX' (two fields); "
                    "`kvframe keygen PATH` writes a valid file"
                )
            kid, hexkey = parts
            if not _KEY_ID.fullmatch(kid):
                raise ConfigError(
                    f"{source}, line {n}: key id {kid[:20]!r} must be 1-16 characters of "
                    "A-Z a-z 0-9 _ -"
                )
            try:
                secret = bytes.fromhex(hexkey)
            except ValueError:
                raise ConfigError(
                    f"{source}, line {n} (key {kid!r}): the secret is not hex"
                ) from None
            if len(secret) < MIN_KEY_BYTES:
                raise ConfigError(
                    f"{source}, line {n} (key {kid!r}): the secret has {len(secret)} bytes; at "
                    f"least {MIN_KEY_BYTES} are needed ({2 * MIN_KEY_BYTES} hex digits)"
                )
            keys.append((kid, secret))
        if not keys:
            raise ConfigError(f"{source} holds no key; `kvframe keygen PATH` writes one")
        return cls(tuple(keys))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyRing:
        """Read a key file. Raises :class:`~kvframe.errors.ConfigError` when it is missing,
        unreadable, too large, readable by other users (mode must deny group and others) or
        malformed."""
        p = Path(path)
        try:
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"auth_key_file {str(p)!r} is not a regular file")
            if st.st_mode & 0o077:
                raise ConfigError(
                    f"auth_key_file {str(p)!r} is readable by other users (mode "
                    f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {p}`"
                )
            if st.st_size > _MAX_KEY_FILE:
                raise ConfigError(
                    f"auth_key_file {str(p)!r} has {st.st_size} bytes; a key file is at most "
                    f"{_MAX_KEY_FILE}"
                )
            text = p.read_text(encoding="ascii")
        except ConfigError:
            raise
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read auth_key_file {str(p)!r}: {exc}") from exc
        return cls.parse(text, f"auth_key_file {str(p)!r}")

    @staticmethod
    def generate_file(path: str | os.PathLike[str], key_id: str = "k1") -> None:
        """Write a new key file with one random :data:`MIN_KEY_BYTES`-byte key, mode 0600.
        Refuses to overwrite an existing file (:class:`FileExistsError`)."""
        if not _KEY_ID.fullmatch(key_id):
            raise ConfigError(f"key id {key_id!r} must be 1-16 characters of A-Z a-z 0-9 _ -")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write("# kvframe fleet key: the first key signs, every key verifies\n")
            f.write(f"{key_id} {secrets.token_hex(MIN_KEY_BYTES)}\n")

    # -- tickets -------------------------------------------------------------------------
    def sign(self, body: bytes) -> str:
        """``KEY_ID:SIGNATURE`` (base64url, no padding) of ``body`` under the signing key."""
        kid, secret = self.keys[0]
        mac = _mac(secret, b"kvframe-ticket", body)
        return f"{kid}:{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"

    def verify(self, body: bytes, ticket: object) -> str | None:
        """``None`` when ``ticket`` is a valid signature of ``body`` by a key of this ring,
        otherwise why not (a sentence; never a secret)."""
        if not isinstance(ticket, str) or len(ticket) > 80 or ticket.count(":") != 1:
            return "it is not a 'KEY_ID:SIGNATURE' string"
        kid, sig = ticket.split(":")
        secret = self.key(kid)
        if secret is None:
            return f"it is signed with key {kid[:16]!r}, which this engine does not hold"
        try:
            got = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
        except ValueError:
            return "its signature is not base64url"
        if not hmac.compare_digest(got, _mac(secret, b"kvframe-ticket", body)):
            return "its signature does not match its fields (altered, or not issued by P)"
        return None

    # -- the side channel ----------------------------------------------------------------
    def proof(self, key_id: str, role: bytes, *parts: bytes) -> bytes | None:
        """The proof of knowing key ``key_id`` for ``role`` (``b"P"`` or ``b"D"``) over
        ``parts`` (nonces and what the proof binds); ``None`` when the ring lacks the key."""
        secret = self.key(key_id)
        if secret is None:
            return None
        return _mac(secret, b"kvframe-handshake", role, *parts)

    def check_proof(self, key_id: str, role: bytes, proof: bytes, *parts: bytes) -> bool:
        """True when ``proof`` is :meth:`proof` of the same arguments (constant time)."""
        want = self.proof(key_id, role, *parts)
        return want is not None and hmac.compare_digest(want, proof)

    def session(self, key_id: str, d_nonce: bytes, p_nonce: bytes) -> bytes | None:
        """The session key of one handshake (see :func:`session_key`)."""
        secret = self.key(key_id)
        return None if secret is None else session_key(secret, d_nonce, p_nonce)


def session_key(secret: bytes, d_nonce: bytes, p_nonce: bytes) -> bytes:
    """The key that tags one connection's notifications: HMAC of both handshake nonces under
    the fleet key, so each handshake gets its own and neither side alone chooses it."""
    return _mac(secret, b"kvframe-session", d_nonce, p_nonce)


def tag(key: bytes, payload: bytes) -> bytes:
    """``payload`` followed by its :data:`TAG_BYTES`-byte tag under the session ``key``."""
    return payload + hmac.digest(key, payload, hashlib.sha256)[:TAG_BYTES]


def untag(key: bytes, data: bytes) -> bytes | None:
    """The payload of a tagged notification, or ``None`` when its tag is wrong or missing."""
    if len(data) <= TAG_BYTES:
        return None
    payload, got = data[:-TAG_BYTES], data[-TAG_BYTES:]
    want = hmac.digest(key, payload, hashlib.sha256)[:TAG_BYTES]
    return payload if hmac.compare_digest(got, want) else None


def ticket_body(fields: Mapping[str, Any]) -> bytes:
    """The canonical bytes a ticket signs: the fields (without the ticket itself) as JSON with
    sorted keys and no spaces. The caller passes fields normalised by parsing
    (:meth:`RemotePrefillParams.to_dict`), so a router that re-serialises the JSON (``30`` for
    ``30.0``, another key order, other spacing) does not break the signature."""
    clean = {k: v for k, v in fields.items() if k != TICKET_FIELD}
    return json.dumps(clean, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def warn_unauthenticated(role: str) -> None:
    """Log, once per process, that this engine runs without a fleet key."""
    global _warned
    if _warned:
        return
    _warned = True
    _log.warning(
        "kvframe P/D connector (%s) runs UNAUTHENTICATED: no auth_key_file is configured, so "
        "anyone who reaches its side-channel port can read and write its registered KV memory "
        "and any client can name another request's blocks in kv_transfer_params. Configure "
        "kv_connector_extra_config.auth_key_file on every engine (see docs/security.md).",
        role,
    )
