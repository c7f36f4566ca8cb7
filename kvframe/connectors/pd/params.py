"""``kv_transfer_params``: what the router carries from P to D, parsed and validated.

Pull mode (the default): the router sends ``{"do_remote_decode": true}`` with the prefill
request; P answers with :meth:`RemotePrefillParams.to_dict`, which the router passes unchanged
to D.

Push mode: the router sends both legs at once, naming one random ``push_id``: P gets
``{"do_remote_decode": true, "transfer_mode": "push", "push_id": ...}``, D gets
``{"do_remote_prefill": true, "transfer_mode": "push", "push_id": ..., **address}`` where
``address`` is P's :meth:`~kvframe.connectors.pd.PDConnector` address
(``PDConnectorScheduler.kv_address()``, parsed here by :class:`PushPrefillParams`). See the
tables in ``docs/pd.md`` for every field.
"""

from __future__ import annotations

import array
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvframe.connectors.pd.auth import TICKET_FIELD, KeyRing, ticket_body
from kvframe.core.fleet import is_engine_id
from kvframe.errors import ConfigError

__all__ = [
    "MAX_BLOCKS_PER_GROUP",
    "MAX_BLOCK_SIZE",
    "MAX_GROUPS",
    "MAX_LEASE_ID_BYTES",
    "MAX_NAME_CHARS",
    "MAX_RANKS",
    "MAX_TOKENS",
    "MAX_TOKEN_CHARS",
    "PushPrefillParams",
    "RemotePrefillParams",
    "decode_engine_of",
    "history_of",
    "prompt_digest",
    "push_id_of",
    "transfer_mode",
    "wants_keep",
    "wants_remote_decode",
    "wants_remote_prefill",
]

#: The longest lease id (``remote_request_id``) D accepts: what one heartbeat entry can carry.
MAX_LEASE_ID_BYTES = 255
#: The most per-rank entries (``remote_ports``, ``remote_incarnations``) D accepts.
MAX_RANKS = 1024
#: The longest incarnation token D accepts.
MAX_TOKEN_CHARS = 64
#: The most KV groups (``remote_block_ids`` entries) D accepts.
MAX_GROUPS = 64
#: The most block ids in one group D accepts (the engine's own limit, the blocks its prompt
#: needs, is checked by the scheduler too).
MAX_BLOCKS_PER_GROUP = 1 << 17
#: The largest ``remote_num_tokens`` D accepts.
MAX_TOKENS = 1 << 24
#: The largest ``remote_block_size`` (tokens per block of P's engine) D accepts.
MAX_BLOCK_SIZE = 1 << 20
#: The longest engine id, host or transport name D accepts.
MAX_NAME_CHARS = 255


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def prompt_digest(token_ids: Sequence[int], n: int) -> str | None:
    """A digest of the first ``n`` prompt tokens: SHA-256 over each as an unsigned 64-bit
    integer, first 128 bits in hex. ``None`` when there are fewer than ``n`` or one is not a
    64-bit unsigned int."""
    if len(token_ids) < n:
        return None
    try:
        packed = array.array("Q", token_ids[:n]).tobytes()
    except (OverflowError, TypeError):
        return None
    return hashlib.sha256(packed).hexdigest()[:32]


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """True when the router asked this (prefill) engine to keep the KV for a remote decoder."""
    return bool(params) and params is not None and params.get("do_remote_decode") is True


def wants_keep(params: Mapping[str, Any] | None) -> bool:
    """True when the router asked this (decode) engine to keep the request's KV for the
    conversation's next turn (``keep_for_next_turn``, bidirectional mode)."""
    return bool(params) and params is not None and params.get("keep_for_next_turn") is True


def history_of(params: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``kv_transfer_params.kv_history``: the parameters a decoder returned for the
    conversation's previous turn (bidirectional mode), or ``None`` when absent.
    :class:`~kvframe.errors.ConfigError` when present but not an object."""
    if not params or "kv_history" not in params:
        return None
    history = params["kv_history"]
    if not isinstance(history, Mapping):
        raise ConfigError(
            f"kv_transfer_params.kv_history = {_short(history)}; expected the object the "
            "decode engine returned for the conversation's previous turn, passed unchanged"
        )
    return history


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """True when the request's KV is to come from a remote prefill engine (pulled or pushed)."""
    return bool(params) and params is not None and params.get("do_remote_prefill") is True


def transfer_mode(params: Mapping[str, Any]) -> str:
    """``kv_transfer_params.transfer_mode``: ``"pull"`` (the default, when absent) or
    ``"push"``; :class:`~kvframe.errors.ConfigError` for anything else."""
    mode = params.get("transfer_mode", "pull")
    if mode not in ("pull", "push"):
        raise ConfigError(
            f"kv_transfer_params.transfer_mode = {_short(mode)}; expected 'pull' (the default) "
            "or 'push'"
        )
    return str(mode)


def push_id_of(params: Mapping[str, Any]) -> str:
    """``kv_transfer_params.push_id``, checked: 16 to 64 characters of ``[A-Za-z0-9_-]`` (the
    router's random name for one request's two legs; ``secrets.token_urlsafe(16)`` makes
    one). :class:`~kvframe.errors.ConfigError` when missing or malformed."""
    value = params.get("push_id")
    if not isinstance(value, str) or not _PUSH_ID.fullmatch(value):
        raise ConfigError(
            f"kv_transfer_params.push_id = {_short(value)}; a push-mode request needs the "
            "router's push id: 16 to 64 characters of [A-Za-z0-9_-], the same on both legs "
            "(secrets.token_urlsafe(16) makes one)"
        )
    return value


_PUSH_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")


def decode_engine_of(params: Mapping[str, Any]) -> str | None:
    """``kv_transfer_params.decode_engine_id`` of a prefill request: the decode engine the
    router will send the ticket to (``None`` when absent). P remembers it with the lease and
    aborts the lease at once, before anyone claimed it, when that engine leaves the fleet.
    Checked as an engine id of the fleet (:class:`~kvframe.core.fleet.EngineRecord`): 1-128
    letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit;
    :class:`~kvframe.errors.ConfigError` otherwise."""
    if "decode_engine_id" not in params:
        return None
    value = params["decode_engine_id"]
    if not is_engine_id(value):
        raise ConfigError(
            f"kv_transfer_params.decode_engine_id = {_short(value)}; expected the decode "
            "engine's id as registered in the fleet: 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (or leave the field out)"
        )
    return str(value)


@attrs.frozen(kw_only=True)
class RemotePrefillParams:
    """The facts D needs to pull a request's KV from P."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_num_tokens: int
    tp_size: int
    transport: str
    lease_duration: float
    lease_expires_at: float
    """Initial lease expiry on P's clock."""
    remote_ports: tuple[int, ...] = ()
    """Per-rank side-channel ports when P's workers bound ephemeral ports; empty when rank
    ``r`` listens on ``remote_port + r``."""
    remote_incarnations: tuple[str, ...] = ()
    """Per rank, a random token naming the P worker instance that granted the lease (empty
    when P's workers did not report theirs). D reconnects to a restarted P before reading."""
    remote_block_size: int = 0
    """Tokens per block of P's engine (``0``: not said, P's blocks are as large as D's). D
    regroups P's blocks into its own when they differ (:mod:`kvframe.core.blocksize`), and
    reads only when P's handshake names the same size."""
    remote_prompt_digest: str = ""
    """:func:`prompt_digest` of the prompt tokens P computed (empty when P's engine gives no
    token ids); D loads only for a prompt with the same digest."""
    ticket: str = ""
    """``kvframe_ticket``: P's signature over every other field (see
    :mod:`kvframe.connectors.pd.auth`); empty when P has no fleet key."""
    kept_until: float | None = None
    """Bidirectional mode: the ticket is of a decoder's blocks kept for a conversation's next
    turn, until this reading of the *decoder's* clock (``None``: an ordinary pull ticket)."""
    kept_ttl: float | None = None
    """Bidirectional mode: ``decoder_kv_blocks_ttl`` of the decoder that kept the blocks (a
    router may forget the conversation's parameters that long after the answer)."""

    def port_for(self, rank: int) -> int:
        """The side-channel port of P's worker ``rank``."""
        if self.remote_ports:
            return self.remote_ports[rank % len(self.remote_ports)]
        return self.remote_port + rank

    def to_dict(self) -> dict[str, Any]:
        """The JSON-compatible ``kv_transfer_params`` P returns."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": [list(g) for g in self.remote_block_ids],
            "remote_num_tokens": self.remote_num_tokens,
            **({"remote_block_size": self.remote_block_size} if self.remote_block_size else {}),
            "tp_size": self.tp_size,
            "transport": self.transport,
            "lease_duration": self.lease_duration,
            "lease_expires_at": self.lease_expires_at,
            **({"remote_ports": list(self.remote_ports)} if self.remote_ports else {}),
            **(
                {"remote_incarnations": list(self.remote_incarnations)}
                if self.remote_incarnations
                else {}
            ),
            **(
                {"remote_prompt_digest": self.remote_prompt_digest}
                if self.remote_prompt_digest
                else {}
            ),
            **({"kept_until": self.kept_until} if self.kept_until is not None else {}),
            **({"kept_ttl": self.kept_ttl} if self.kept_ttl is not None else {}),
            **({TICKET_FIELD: self.ticket} if self.ticket else {}),
        }

    def signed(self, ring: KeyRing) -> RemotePrefillParams:
        """These parameters with a ticket signed by ``ring``'s signing key."""
        unsigned = attrs.evolve(self, ticket="")
        return attrs.evolve(self, ticket=ring.sign(ticket_body(unsigned.to_dict())))

    def verify(self, ring: KeyRing) -> None:
        """Raise :class:`~kvframe.errors.ConfigError` unless the ticket is a valid signature,
        by a key of ``ring``, of exactly these (parsed) fields."""
        if not self.ticket:
            raise ConfigError(
                f"kv_transfer_params.{TICKET_FIELD} is missing but this engine has a fleet key "
                "(auth_key_file): the prefill engine must have the same key file, and the "
                "router must pass P's kv_transfer_params through unchanged"
            )
        why = ring.verify(ticket_body(attrs.evolve(self, ticket="").to_dict()), self.ticket)
        if why is not None:
            raise ConfigError(f"kv_transfer_params.{TICKET_FIELD} refused: {why}")

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> RemotePrefillParams:
        """Parse what the router passed to D.

        Raises :class:`~kvframe.errors.ConfigError` naming the first bad field, its value and
        what is expected; the caller then prefills the request locally.
        """

        def get(key: str, typ: type | tuple[type, ...], what: str) -> Any:
            if key not in params:
                raise ConfigError(
                    f"kv_transfer_params.{key} is missing; a remote-prefill request needs "
                    "every field P returned (pass P's kv_transfer_params through unchanged)"
                )
            value = params[key]
            if isinstance(value, bool) or not isinstance(value, typ):
                raise ConfigError(f"kv_transfer_params.{key} = {value!r}; expected {what}")
            return value

        def non_empty(key: str, limit: int = MAX_NAME_CHARS) -> str:
            value: str = get(key, str, "a non-empty string")
            if not value:
                raise ConfigError(f"kv_transfer_params.{key} is empty; expected a non-empty string")
            if len(value) > limit:
                raise ConfigError(
                    f"kv_transfer_params.{key} has {len(value)} characters; at most {limit}"
                )
            return value

        def bounded(key: str, value: Any, limit: int, what: str) -> None:
            if len(value) > limit:
                raise ConfigError(
                    f"kv_transfer_params.{key} has {len(value)} {what}; at most {limit} are "
                    "accepted (pass P's kv_transfer_params through unchanged)"
                )

        def count(key: str, lo: int, hi: int) -> int:
            value: int = get(key, int, f"an integer >= {lo}")
            if not lo <= value <= hi:
                raise ConfigError(f"kv_transfer_params.{key} = {value!r}; expected {lo}..{hi}")
            return value

        def seconds(key: str) -> float:
            value = float(get(key, (int, float), "a finite number of seconds"))
            if not math.isfinite(value):
                raise ConfigError(f"kv_transfer_params.{key} = {value!r}; expected a finite number")
            return value

        groups_raw = get("remote_block_ids", (list, tuple), "a list of lists of block ids")
        bounded("remote_block_ids", groups_raw, MAX_GROUPS, "KV groups")
        groups: list[tuple[int, ...]] = []
        for g, group in enumerate(groups_raw):
            if isinstance(group, (list, tuple)):
                bounded(f"remote_block_ids[{g}]", group, MAX_BLOCKS_PER_GROUP, "block ids")
            if not isinstance(group, (list, tuple)) or not all(
                type(b) is int and b >= 0 for b in group
            ):
                raise ConfigError(
                    f"kv_transfer_params.remote_block_ids[{g}] = {group!r}; expected a list of "
                    "non-negative integer block ids"
                )
            groups.append(tuple(group))
        if not groups:
            raise ConfigError("kv_transfer_params.remote_block_ids is empty; expected >= 1 group")
        port = count("remote_port", 1, 65535)
        duration = seconds("lease_duration")
        if duration <= 0:
            raise ConfigError(f"kv_transfer_params.lease_duration = {duration}; expected > 0")
        ports_raw = params.get("remote_ports", [])
        if isinstance(ports_raw, (list, tuple)):
            bounded("remote_ports", ports_raw, MAX_RANKS, "ports")
        if not isinstance(ports_raw, (list, tuple)) or not all(
            type(p) is int and 1 <= p <= 65535 for p in ports_raw
        ):
            raise ConfigError(
                f"kv_transfer_params.remote_ports = {ports_raw!r}; expected a list of ports"
            )
        inc_raw = params.get("remote_incarnations", [])
        digest = params.get("remote_prompt_digest", "")
        if not isinstance(digest, str) or len(digest) > 64:
            raise ConfigError(
                f"kv_transfer_params.remote_prompt_digest = {_short(digest)}; expected the "
                "string P returned (at most 64 characters)"
            )
        ticket = params.get(TICKET_FIELD, "")
        if not isinstance(ticket, str) or len(ticket) > 80:
            raise ConfigError(
                f"kv_transfer_params.{TICKET_FIELD} = {_short(ticket)}; expected the string P "
                "returned (at most 80 characters)"
            )
        if (
            not isinstance(inc_raw, (list, tuple))
            or len(inc_raw) > MAX_RANKS
            or not all(isinstance(x, str) and 0 < len(x) <= MAX_TOKEN_CHARS for x in inc_raw)
        ):
            raise ConfigError(
                f"kv_transfer_params.remote_incarnations = {_short(inc_raw)}; expected a list "
                f"of at most {MAX_RANKS} non-empty strings of at most {MAX_TOKEN_CHARS} characters"
            )
        block_size = (
            count("remote_block_size", 1, MAX_BLOCK_SIZE) if "remote_block_size" in params else 0
        )
        kept: dict[str, float] = {}
        for key in ("kept_until", "kept_ttl"):
            if key in params:
                kept[key] = seconds(key)
        if kept.get("kept_ttl", 1.0) <= 0:
            raise ConfigError(f"kv_transfer_params.kept_ttl = {kept['kept_ttl']}; expected > 0")
        lease_id = non_empty("remote_request_id")
        if len(lease_id.encode("utf-8", "surrogatepass")) > MAX_LEASE_ID_BYTES:
            raise ConfigError(
                f"kv_transfer_params.remote_request_id is {len(lease_id)} characters; a lease id "
                f"is at most {MAX_LEASE_ID_BYTES} bytes (pass P's kv_transfer_params unchanged)"
            )
        return cls(
            remote_ports=tuple(ports_raw),
            remote_incarnations=tuple(inc_raw),
            remote_engine_id=non_empty("remote_engine_id"),
            remote_request_id=lease_id,
            remote_host=non_empty("remote_host"),
            remote_port=port,
            remote_block_ids=tuple(groups),
            remote_num_tokens=count("remote_num_tokens", 0, MAX_TOKENS),
            remote_block_size=block_size,
            tp_size=count("tp_size", 1, MAX_RANKS),
            transport=non_empty("transport", 64),
            lease_duration=duration,
            lease_expires_at=seconds("lease_expires_at"),
            remote_prompt_digest=digest,
            ticket=ticket,
            kept_until=kept.get("kept_until"),
            kept_ttl=kept.get("kept_ttl"),
        )


@attrs.frozen(kw_only=True)
class PushPrefillParams:
    """What D needs for a push-mode request: the router's push id and P's address (the
    fields of ``PDConnectorScheduler.kv_address()``). Nothing here needs a signature: D
    checks, in the authenticated handshake, that the engine it reaches holds the fleet key
    and is ``remote_engine_id``; P checks D's registration against its own prompt."""

    push_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    transport: str
    remote_ports: tuple[int, ...] = ()
    remote_incarnations: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> PushPrefillParams:
        """Parse D's leg of a push-mode request. Raises :class:`~kvframe.errors.ConfigError`
        naming the first bad field (the request is then prefilled locally)."""
        push_id = push_id_of(params)
        # The address fields are checked exactly as a pull ticket's.
        probe = dict(params)
        probe.setdefault("remote_request_id", push_id)
        probe.setdefault("remote_block_ids", [[]])
        probe.setdefault("remote_num_tokens", 0)
        probe.setdefault("lease_duration", 1.0)
        probe.setdefault("lease_expires_at", 0.0)
        base = RemotePrefillParams.from_dict(probe)
        return cls(
            push_id=push_id,
            remote_engine_id=base.remote_engine_id,
            remote_host=base.remote_host,
            remote_port=base.remote_port,
            tp_size=base.tp_size,
            transport=base.transport,
            remote_ports=base.remote_ports,
            remote_incarnations=base.remote_incarnations,
        )
