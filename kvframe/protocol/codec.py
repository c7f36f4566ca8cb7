"""The one codec for scheduler↔worker messages: frozen attrs values ⇄ bytes.

Envelope (all integers big-endian)::

    offset  size  field
    0       4     magic  b"KVFM"
    4       2     protocol version (uint16), currently 1
    6       1     tag length n (uint8, 1..64)
    7       n     type tag, ASCII (e.g. b"kvframe.metadata")
    7+n     ...   body: one msgpack map, field name → value (nothing may follow it)

Values are encoded by their declared attrs field types: ``str``, ``int``, ``float``, ``bool``,
``bytes``, ``None``, unions of those, ``tuple[X, ...]`` (array), ``frozenset[X]`` (array,
sorted so equal values give equal bytes), ``Mapping[K, V]`` (map), enums whose values are all
``str`` or all ``int`` (the member's value), nested attrs classes (map of their fields) and
``Any`` (a plain value, see :func:`kvframe.protocol.messages.freeze_plain`).
Never pickle: decoding runs no code and builds only the registered classes.

Decoding is total: any input that is not a valid encoding raises
:class:`~kvframe.errors.CodecError` (or its subclasses
:class:`~kvframe.errors.UnknownMessageTypeError` for a tag this codec does not know and
:class:`~kvframe.errors.UnsupportedVersionError` for a protocol version it cannot read) and
nothing else. A codec is immutable and stateless; after an error it stays usable.
"""

from __future__ import annotations

import contextlib
import enum
import re
import struct
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs
import msgpack

from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError
from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    freeze_plain,
    thaw_plain,
)

__all__ = [
    "DEFAULT_CODEC",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Codec",
]

MAGIC = b"KVFM"
"""The first four bytes of every encoded message."""
PROTOCOL_VERSION = 1
"""The version this codec writes."""
SUPPORTED_VERSIONS = frozenset({1})
"""The versions this codec reads."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default size limit of one encoded message (larger input is rejected unread)."""

_HEADER = struct.Struct(">4sHB")
_TAG = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
_MAX_TAG = 64
_BUILTIN_PREFIX = "kvframe."
_BUILTINS: tuple[tuple[str, type[Any]], ...] = (
    ("kvframe.metadata", ConnectorMetadata),
    ("kvframe.output", ConnectorOutput),
)

_T = TypeVar("_T")


class _Bad(Exception):
    """A decoding failure at ``path``; turned into CodecError at the boundary."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")


# A converter pair: encode(value, path) -> wire value; decode(wire value, path) -> value.
# Encoding raises TypeError (a local bug: the message holds a value of the wrong type);
# decoding raises _Bad (the bytes are wrong).
_Enc = Callable[[Any, str], Any]
_Dec = Callable[[Any, str], Any]


@attrs.frozen
class _Conv:
    enc: _Enc
    dec: _Dec
    exact: type[Any] | None = None
    """Set for scalar types whose values pass through unchanged: sequences of them take a
    fast path that checks ``type(v) is exact`` without building a path per item."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", repr(tp))


def _scalar(tp: type[Any]) -> _Conv:
    def check(value: Any) -> bool:
        if tp is int:
            return type(value) is int
        if tp is float:
            return type(value) is float or type(value) is int
        if tp is type(None):
            return value is None
        return isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))

    def enc(value: Any, path: str) -> Any:
        if not check(value):
            raise TypeError(f"{path} = {value!r}; expected {_type_name(tp)}")
        return float(value) if tp is float else value

    def dec(value: Any, path: str) -> Any:
        if not check(value):
            raise _Bad(path, f"expected {_type_name(tp)}, got {type(value).__name__}")
        return float(value) if tp is float else value

    return _Conv(enc, dec, tp if tp in (int, str, bytes, bool) else None)


def _any() -> _Conv:
    def enc(value: Any, path: str) -> Any:
        return thaw_plain(freeze_plain(value, path))

    def dec(value: Any, path: str) -> Any:
        try:
            return freeze_plain(value, path)
        except TypeError as exc:
            raise _Bad(path, str(exc)) from exc

    return _Conv(enc, dec)


def _enum(tp: type[enum.Enum], where: str) -> _Conv:
    by_value = {m.value: m for m in tp}
    kinds = {type(v) for v in by_value}
    if not by_value or not (kinds == {str} or kinds == {int}):
        raise TypeError(
            f"{where}: the codec carries enums whose values are all str or all int; "
            f"{tp.__qualname__} has values {sorted(map(repr, by_value))}"
        )
    (kind,) = kinds
    name = tp.__qualname__
    known = sorted(by_value)

    def enc(value: Any, path: str) -> Any:
        if type(value) is not tp:
            raise TypeError(f"{path} = {value!r}; expected a {name}")
        return value.value

    def dec(value: Any, path: str) -> Any:
        member = by_value.get(value) if type(value) is kind else None
        if member is None:
            raise _Bad(path, f"{value!r} is not a {name} (one of {known})")
        return member

    return _Conv(enc, dec)


def _union(members: tuple[Any, ...], where: str, cache: dict[Any, _Conv | None]) -> _Conv:
    convs = [_compile(m, where, cache) for m in members]
    kinds = ", ".join(_type_name(m) for m in members)

    def enc(value: Any, path: str) -> Any:
        for c in convs:
            try:
                return c.enc(value, path)
            except TypeError:
                continue
        raise TypeError(f"{path} = {value!r}; expected one of {kinds}")

    def dec(value: Any, path: str) -> Any:
        for c in convs:
            try:
                return c.dec(value, path)
            except _Bad:
                continue
        raise _Bad(path, f"expected one of {kinds}, got {type(value).__name__}")

    return _Conv(enc, dec)


def _sequence(item: _Conv, as_set: bool) -> _Conv:
    exact = item.exact

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise TypeError(f"{path} = {value!r}; expected a collection")
        out = list(value)
        if exact is None or not all(type(v) is exact for v in out):
            out = [item.enc(v, f"{path}[{i}]") for i, v in enumerate(out)]
        if as_set:
            # Sorted so that equal sets give equal bytes; mixed kinds keep iteration order
            # (decoding does not depend on the order).
            with contextlib.suppress(TypeError):
                out.sort()
        return out

    def dec(value: Any, path: str) -> Any:
        if not isinstance(value, (list, tuple)):
            raise _Bad(path, f"expected an array, got {type(value).__name__}")
        if exact is not None and all(type(v) is exact for v in value):
            return frozenset(value) if as_set else tuple(value)
        items = [item.dec(v, f"{path}[{i}]") for i, v in enumerate(value)]
        try:
            return frozenset(items) if as_set else tuple(items)
        except TypeError as exc:
            raise _Bad(path, "set items must be hashable") from exc

    return _Conv(enc, dec)


def _mapping(key: _Conv, val: _Conv) -> _Conv:
    def enc(value: Any, path: str) -> Any:
        if not isinstance(value, Mapping):
            raise TypeError(f"{path} = {value!r}; expected a mapping")
        return {key.enc(k, f"{path} key"): val.enc(v, f"{path}[{k!r}]") for k, v in value.items()}

    def dec(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _Bad(path, f"expected a map, got {type(value).__name__}")
        return types.MappingProxyType(
            {key.dec(k, f"{path} key"): val.dec(v, f"{path}[{k!r}]") for k, v in value.items()}
        )

    return _Conv(enc, dec)


def _attrs_class(cls: type[Any], cache: dict[Any, _Conv | None]) -> _Conv:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:
        raise TypeError(f"cannot resolve the field types of {cls.__qualname__}: {exc}") from exc
    fields = [f for f in attrs.fields(cls) if f.init]
    convs: dict[str, _Conv] = {}
    for f in fields:
        if f.alias != f.name:
            raise TypeError(
                f"{cls.__qualname__}.{f.name}: fields with an init alias are not supported"
            )
        convs[f.name] = _compile(hints[f.name], f"{cls.__qualname__}.{f.name}", cache)
    name = cls.__qualname__

    def enc(value: Any, path: str) -> Any:
        if type(value) is not cls:
            raise TypeError(f"{path} = {value!r}; expected a {name}")
        return {n: c.enc(getattr(value, n), f"{path}.{n}") for n, c in convs.items()}

    def dec(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _Bad(path, f"expected a map of {name}'s fields, got {type(value).__name__}")
        unknown = [k for k in value if k not in convs]
        if unknown:
            raise _Bad(path, f"{name} has no field {unknown[0]!r}")
        kwargs = {k: convs[k].dec(v, f"{path}.{k}") for k, v in value.items()}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            # A missing required field or a value the class's validators reject.
            raise _Bad(path, f"not a valid {name}: {exc}") from exc

    return _Conv(enc, dec)


def _compile(tp: Any, where: str, cache: dict[Any, _Conv | None]) -> _Conv:
    """A converter for the declared type ``tp`` (of the field named by ``where``).

    Raises ``TypeError`` naming the field for a type the codec cannot carry.
    """
    if tp in cache:
        hit = cache[tp]
        if hit is None:
            raise TypeError(f"{where}: recursive message types are not supported")
        return hit
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    conv: _Conv
    if tp is Any:
        conv = _any()
    elif tp in (str, int, float, bool, bytes, type(None), None):
        conv = _scalar(type(None) if tp is None else tp)
    elif origin in (typing.Union, types.UnionType):
        conv = _union(args, where, cache)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        conv = _sequence(_compile(args[0], where, cache), as_set=False)
    elif origin is frozenset and len(args) == 1:
        conv = _sequence(_compile(args[0], where, cache), as_set=True)
    elif origin in (Mapping, dict) and len(args) == 2:
        conv = _mapping(_compile(args[0], where, cache), _compile(args[1], where, cache))
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        conv = _enum(tp, where)
    elif isinstance(tp, type) and attrs.has(tp):
        cache[tp] = None  # marks "being compiled" so that a recursive type is refused
        conv = _attrs_class(tp, cache)
    else:
        raise TypeError(
            f"{where}: the codec cannot carry values of type {tp!r}; use str, int, float, bool, "
            "bytes, None, tuple[X, ...], frozenset[X], Mapping[K, V], str or int enums, attrs "
            "classes or Any"
        )
    cache[tp] = conv
    return conv


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not used by kvframe messages")


def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or len(tag) > _MAX_TAG or not _TAG.fullmatch(tag):
        raise ValueError(
            f"message tag {tag!r} is not valid: use a dotted lowercase name of at most "
            f"{_MAX_TAG} characters that starts with your distribution's name, "
            "e.g. 'mypkg.metadata'"
        )


class Codec:
    """Encodes and decodes registered message types.

    ``Codec()`` knows the built-in messages (:class:`~kvframe.protocol.messages.ConnectorMetadata`
    as ``"kvframe.metadata"`` and :class:`~kvframe.protocol.messages.ConnectorOutput` as
    ``"kvframe.output"``). :meth:`with_types` returns a *new* codec that also knows a
    connector's own classes; a codec never changes after construction, so no test or plugin
    can change what another one decodes.

    ``max_message_bytes`` bounds what :meth:`decode` reads (and what :meth:`encode` produces).
    """

    __slots__ = ("_by_cls", "_by_tag", "_convs", "_max", "_top")

    def __init__(self, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if type(max_message_bytes) is not int or max_message_bytes < _HEADER.size + 2:
            raise ValueError(f"max_message_bytes = {max_message_bytes!r}; it must be an int > 8")
        self._max = max_message_bytes
        self._by_tag: dict[str, type[Any]] = {}
        self._by_cls: dict[type[Any], str] = {}
        self._convs: dict[Any, _Conv | None] = {}
        self._top: dict[type[Any], _Conv] = {}
        for tag, cls in _BUILTINS:
            self._add(tag, cls)

    def _add(self, tag: str, cls: type[Any]) -> None:
        if not (isinstance(cls, type) and attrs.has(cls)):
            raise TypeError(f"{cls!r} (tag {tag!r}) is not an attrs class")
        if tag in self._by_tag:
            raise ValueError(
                f"tag {tag!r} is already registered for {self._by_tag[tag].__qualname__}"
            )
        if cls in self._by_cls:
            raise ValueError(
                f"{cls.__qualname__} is already registered under tag {self._by_cls[cls]!r}"
            )
        self._top[cls] = _compile(cls, cls.__qualname__, self._convs)
        self._by_tag[tag] = cls
        self._by_cls[cls] = tag

    def with_types(self, registry: Mapping[str, type[Any]]) -> Codec:
        """A new codec that knows everything this one knows plus ``registry`` (tag → class).

        Each class must be an attrs class whose fields have types the codec can carry (see
        the module docstring); subclasses of ``ConnectorMetadata`` are the usual case. Tags are
        dotted lowercase names starting with the registering distribution's name;
        ``"kvframe."`` is reserved.

        Raises ``ValueError`` for a malformed, reserved or already registered tag or an already
        registered class, and ``TypeError`` for a class or field type the codec cannot carry
        (the message names the field). This codec is unchanged either way.
        """
        new = Codec(max_message_bytes=self._max)
        for tag, cls in self._by_tag.items():
            if not tag.startswith(_BUILTIN_PREFIX):
                new._add(tag, cls)
        for tag, cls in registry.items():
            _check_tag(tag)
            if tag.startswith(_BUILTIN_PREFIX):
                raise ValueError(f"tag {tag!r}: the 'kvframe.' prefix is reserved for kvframe")
            new._add(tag, cls)
        return new

    @property
    def tags(self) -> Mapping[str, type[Any]]:
        """Every registered tag and its class (read-only)."""
        return types.MappingProxyType(self._by_tag)

    @property
    def max_message_bytes(self) -> int:
        """The size limit of one encoded message."""
        return self._max

    def encode(self, message: object) -> bytes:
        """The envelope bytes for ``message``.

        The message's exact class must be registered (a subclass is not encoded as its base:
        that would drop its fields). Raises ``TypeError`` for an unregistered class or a field
        holding a value of the wrong type, and ``ValueError`` when the result would exceed
        ``max_message_bytes``. Nothing is returned then.
        """
        cls = type(message)
        tag = self._by_cls.get(cls)
        if tag is None:
            raise TypeError(
                f"{cls.__qualname__} is not registered with this codec; "
                "register it with codec.with_types({'yourpkg.name': cls})"
            )
        body = self._top[cls].enc(message, cls.__qualname__)
        tag_bytes = tag.encode("ascii")
        data = _HEADER.pack(MAGIC, PROTOCOL_VERSION, len(tag_bytes)) + tag_bytes
        data += bytes(msgpack.packb(body, use_bin_type=True))
        if len(data) > self._max:
            raise ValueError(
                f"encoded {cls.__qualname__} is {len(data)} bytes, over the limit of "
                f"{self._max}; split the work over several steps or raise max_message_bytes"
            )
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> object:
        """The message encoded in ``data``.

        Raises :class:`~kvframe.errors.UnsupportedVersionError` for a protocol version not in
        :data:`SUPPORTED_VERSIONS`, :class:`~kvframe.errors.UnknownMessageTypeError` for an
        unregistered tag, and :class:`~kvframe.errors.CodecError` for anything else wrong (bad
        magic, truncation, oversize, trailing bytes, a field of the wrong type, a value the
        message class rejects); the message names what was wrong. Raises ``TypeError`` only
        when ``data`` is not bytes-like at all.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"decode() takes bytes, got {type(data).__name__}")
        raw = bytes(data)
        if len(raw) > self._max:
            raise CodecError(f"message is {len(raw)} bytes, over the limit of {self._max}")
        if len(raw) < _HEADER.size:
            raise CodecError(f"message is {len(raw)} bytes, shorter than the 7-byte header")
        magic, version, tag_len = _HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise CodecError(f"bad magic {magic!r}; expected {MAGIC!r} (not a kvframe message)")
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"protocol version {version}; this side reads {sorted(SUPPORTED_VERSIONS)}. "
                "Run the same kvframe version in the scheduler and every worker"
            )
        end = _HEADER.size + tag_len
        if tag_len == 0 or len(raw) < end:
            raise CodecError(f"truncated or empty type tag (length {tag_len})")
        try:
            tag = raw[_HEADER.size : end].decode("ascii")
        except UnicodeDecodeError as exc:
            raise CodecError("type tag is not ASCII") from exc
        cls = self._by_tag.get(tag)
        if cls is None:
            raise UnknownMessageTypeError(
                f"unknown message type {tag!r}; this codec knows {sorted(self._by_tag)}"
            )
        try:
            body = msgpack.unpackb(
                raw[end:],
                raw=False,
                use_list=False,
                strict_map_key=True,
                ext_hook=_refuse_ext,
            )
        except Exception as exc:
            # msgpack reports malformed input with several exception types (ExtraData,
            # FormatError, StackError, ValueError, TypeError, ...): all mean "not a message".
            raise CodecError(f"{tag} body is not valid msgpack: {exc}") from exc
        try:
            result: object = self._top[cls].dec(body, cls.__qualname__)
        except _Bad as exc:
            raise CodecError(f"malformed {tag}: {exc}") from exc
        except RecursionError as exc:
            raise CodecError(f"malformed {tag}: nested too deeply") from exc
        return result

    def decode_as(self, data: bytes | bytearray | memoryview, cls: type[_T]) -> _T:
        """Like :meth:`decode`, and check that the message is a ``cls``.

        Raises :class:`~kvframe.errors.CodecError` when it is another registered type (plus
        everything :meth:`decode` raises).
        """
        msg = self.decode(data)
        if not isinstance(msg, cls):
            raise CodecError(f"expected a {cls.__qualname__}, got a {type(msg).__qualname__}")
        return msg


DEFAULT_CODEC = Codec()
"""A codec that knows the built-in messages. Immutable: share it freely."""
