"""The one codec for scheduler↔worker messages: frozen attrs values ⇄ bytes, on msgspec.

Envelope (all integers big-endian)::

    offset  size  field
    0       4     magic  b"KVFM"
    4       2     protocol version (uint16), currently 2
    6       1     tag length n (uint8, 1..64)
    7       n     type tag, ASCII (e.g. b"kvframe.metadata")
    7+n     4     layout: CRC-32 of the class's field names and types, nested classes included
    11+n    ...   body: one msgpack map, field name → value (nothing may follow it)

Values are encoded by their declared attrs field types: ``str``, ``int``, ``float``, ``bool``,
``bytes``, ``None``, unions of those, ``tuple[X, ...]`` (array), ``frozenset[X]`` (array,
sorted so equal values give equal bytes), ``Mapping[K, V]`` (map), enums whose values are all
``str`` or all ``int`` (the member's value), nested attrs classes (map of their fields),
``Annotated[X, msgspec.Meta(...)]`` (an ``X`` whose bounds the decoder checks) and ``Any`` (a
plain value, see :func:`kvframe.protocol.messages.freeze_plain`).
Never pickle: decoding runs no code but the registered classes' own checks and builds only
the registered classes.

How it is fast: msgspec (C) writes the attrs values directly and, on decoding, checks every
value against its declared type and builds the attrs instances directly (their validators
and ``__attrs_post_init__`` run; ``__init__`` does not). Afterwards one pass per message,
compiled at registration, does what ``__init__`` would have done beyond that: maps become
:class:`~kvframe.protocol.messages.FrozenDict`, ``Any`` values are frozen, and each field's
attrs converter runs on the decoded value — except converters marked with
:func:`type_checked` (they only check what the declared type already says) and a value equal
to the field's default (it gets the converted default, computed once). The layout checksum
stands in for a field-by-field check of the map keys: a sender whose class has other fields
or types is refused as a whole (msgspec itself skips map keys that are not fields).

Decoding is total: any input that is not a valid encoding raises
:class:`~kvframe.errors.CodecError` (or its subclasses
:class:`~kvframe.errors.UnknownMessageTypeError` for a tag this codec does not know and
:class:`~kvframe.errors.UnsupportedVersionError` for a protocol version it cannot read) and
nothing else. A codec is immutable and stateless; after an error it stays usable.
"""

from __future__ import annotations

import enum
import re
import struct
import types
import typing
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import attrs
import msgspec

from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError
from kvframe.protocol import messages as _messages
from kvframe.protocol.blocks import as_block_ids
from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    FrozenDict,
    freeze_plain,
)

__all__ = [
    "DEFAULT_CODEC",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "Codec",
    "type_checked",
]

MAGIC = b"KVFM"
"""The first four bytes of every encoded message."""
PROTOCOL_VERSION = 2
"""The version this codec writes (2: the layout checksum after the tag; msgspec's body)."""
SUPPORTED_VERSIONS = frozenset({2})
"""The versions this codec reads."""
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Default size limit of one encoded message (larger input is rejected unread)."""

_HEADER = struct.Struct(">4sHB")
_LAYOUT = 4
_TAG = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
_MAX_TAG = 64
_BUILTIN_PREFIX = "kvframe."
_BUILTINS: tuple[tuple[str, type[Any]], ...] = (
    ("kvframe.metadata", ConnectorMetadata),
    ("kvframe.output", ConnectorOutput),
)
_EMPTY = FrozenDict()
_set = object.__setattr__

_T = TypeVar("_T")

_TYPE_CHECKED: set[Any] = {
    # The built-in messages' converters that only check what msgspec's typed decoding does
    # (block ids' bounds are in BlockId); Stats' checks (finite, non-negative) still run.
    as_block_ids,
    _messages._loads,
    _messages._saves,
    _messages._events,
    _messages._str_set,
    _messages._int_set,
    _messages._extra,
    _messages._event_data,
    _messages._failures,
}


def type_checked(*converters: Callable[[Any], Any]) -> None:
    """Mark attrs converters as ones that check nothing the field's declared type does not
    (item types, lists to tuples): the codec then skips them when it decodes such a field,
    because msgspec has already checked the type.

    Mark the converters of fields on a connector's hot path (per-step metadata), and express
    value bounds in the type (``Annotated[int, msgspec.Meta(ge=0)]``, like
    :data:`~kvframe.protocol.blocks.BlockId`) rather than in the converter. Call it after the
    functions' definitions (``type_checked(_loads, _blocks)``); a decorator would hide the
    converters from mypy's attrs plugin.
    """
    _TYPE_CHECKED.update(converters)


class _Bad(Exception):
    """A decoding failure at ``path``; turned into CodecError at the boundary."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")


# A fixer turns what msgspec decoded for one declared type into the value __init__ would
# hold; None means "nothing to do" (the common case: scalars, tuples of scalars, enums).
_Fix = Callable[[Any], Any]


def _fix_any(path: str) -> _Fix:
    def fix(value: Any) -> Any:
        try:
            return freeze_plain(value, path)
        except TypeError as exc:
            raise _Bad(path, str(exc)) from exc

    return fix


def _fix_mapping(val: _Fix | None) -> _Fix:
    def fix(value: Any) -> Any:
        if not value:
            return _EMPTY
        if val is None:
            return FrozenDict(value)
        return FrozenDict({k: val(v) for k, v in value.items()})

    return fix


def _fix_items(item: _Fix, as_set: bool, path: str) -> _Fix:
    def fix(value: Any) -> Any:
        out = [item(v) for v in value]
        try:
            return frozenset(out) if as_set else tuple(out)
        except TypeError as exc:
            raise _Bad(path, "set items must be hashable") from exc

    return fix


def _fix_union(members: list[tuple[type[Any], _Fix]]) -> _Fix:
    def fix(value: Any) -> Any:
        for kind, f in members:
            if isinstance(value, kind):
                return f(value)
        return value

    return fix


class _Compiler:
    """Checks declared types at registration; gives each its fixer and its layout text."""

    def __init__(self) -> None:
        self.cache: dict[Any, tuple[_Fix | None, str] | None] = {}

    def compile(self, tp: Any, where: str) -> tuple[_Fix | None, str]:
        """The fixer and the layout text of the declared type ``tp`` (of the field ``where``).

        Raises ``TypeError`` naming the field for a type the codec cannot carry.
        """
        try:
            hit = self.cache[tp]
        except TypeError:  # an unhashable annotation (Annotated with odd metadata)
            hit = None
            cacheable = False
        except KeyError:
            cacheable = True
        else:
            if hit is None:
                raise TypeError(f"{where}: recursive message types are not supported")
            return hit
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        out: tuple[_Fix | None, str]
        if origin is typing.Annotated:
            fix, text = self.compile(args[0], where)
            out = fix, f"{text}@{args[1:]!r}"
        elif tp is Any:
            out = _fix_any("a plain value"), "any"
        elif tp in (str, int, float, bool, bytes, type(None), None):
            out = None, "none" if tp in (None, type(None)) else tp.__name__
        elif origin in (typing.Union, types.UnionType):
            parts = [(m, self.compile(m, where)) for m in args]
            fixed = []
            for m, (fix, _) in parts:
                if fix is not None:
                    fixed.append((_runtime_kind(m), fix))
            text = "|".join(t for _, (_, t) in parts)
            out = (_fix_union(fixed) if fixed else None), f"({text})"
        elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            fix, text = self.compile(args[0], where)
            out = (_fix_items(fix, False, where) if fix else None), f"tuple[{text}]"
        elif origin is frozenset and len(args) == 1:
            fix, text = self.compile(args[0], where)
            out = (_fix_items(fix, True, where) if fix else None), f"frozenset[{text}]"
        elif origin in (Mapping, dict) and len(args) == 2:
            kfix, ktext = self.compile(args[0], where)
            vfix, vtext = self.compile(args[1], where)
            if kfix is not None:
                raise TypeError(f"{where}: map keys must be scalars, str or int enums")
            out = _fix_mapping(vfix), f"map[{ktext},{vtext}]"
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            out = None, _enum_text(tp, where)
        elif isinstance(tp, type) and attrs.has(tp):
            if cacheable:
                self.cache[tp] = None  # "being compiled": a recursive type is refused
            out = self._attrs_class(tp)
        else:
            raise TypeError(
                f"{where}: the codec cannot carry values of type {tp!r}; use str, int, float, "
                "bool, bytes, None, tuple[X, ...], frozenset[X], Mapping[K, V], str or int "
                "enums, attrs classes or Any"
            )
        if cacheable:
            self.cache[tp] = out
        return out

    def _attrs_class(self, cls: type[Any]) -> tuple[_Fix | None, str]:
        try:
            hints = typing.get_type_hints(cls, include_extras=True)
        except Exception as exc:
            raise TypeError(f"cannot resolve the field types of {cls.__qualname__}: {exc}") from exc
        steps: list[_Step] = []
        texts = []
        for f in attrs.fields(cls):
            where = f"{cls.__qualname__}.{f.name}"
            if not f.init:
                raise TypeError(f"{where}: fields with init=False are not supported")
            if f.alias != f.name:
                raise TypeError(f"{where}: fields with an init alias are not supported")
            fix, text = self.compile(hints[f.name], where)
            texts.append(f"{f.name}:{text}")
            step = _Step.make(f, fix, where, _is_mapping(hints[f.name]))
            if step is not None:
                steps.append(step)
        text = f"{cls.__qualname__}{{{','.join(texts)}}}"
        return (_finisher(cls, steps) if steps else None), text


def _finisher(cls: type[Any], steps: list[_Step]) -> _Fix:
    """One straight-line function that finishes a decoded ``cls`` (generated, as attrs
    generates ``__init__``: a loop over the steps costs several times more per message)."""
    ns: dict[str, Any] = {"_set": _set, "_convert": _convert, "_EMPTY": _EMPTY}
    lines = ["def finish(inst):"]
    for i, step in enumerate(steps):
        name = step.name
        ns[f"step{i}"] = step
        lines.append(f"    v = inst.{name}")
        pad = "    "
        if step.converter is not None and step.default is not _NO_DEFAULT:
            # The decoded value equals the default: the converted default, computed once.
            ns[f"d{i}"], ns[f"t{i}"] = step.default, type(step.default)
            lines.append(f"    if type(v) is t{i} and v == d{i}:")
            ns[f"c{i}"] = step.converted_default
            lines.append(f"        n = c{i}")
            lines.append("    else:")
            pad = "        "
        ns[f"fix{i}"] = step.fix
        if step.fix is None:
            lines.append(f"{pad}n = v")
        elif step.mapping:
            lines.append(f"{pad}n = fix{i}(v) if v else _EMPTY")
        else:
            lines.append(f"{pad}n = fix{i}(v)")
        if step.converter is not None:
            lines.append(f"{pad}n = _convert(step{i}, inst, n)")
        lines.append("    if n is not v:")
        lines.append(f"        _set(inst, {name!r}, n)")
    lines.append("    return inst")
    exec(compile("\n".join(lines), f"<kvframe codec: finish {cls.__qualname__}>", "exec"), ns)
    fix: _Fix = ns["finish"]
    return fix


def _convert(step: _Step, inst: Any, value: Any) -> Any:
    """``step``'s converter (and then its validator) on a decoded value, as ``__init__`` runs
    them; what they raise becomes a decoding failure."""
    try:
        new = step.converter(value)  # type: ignore[misc]
        if step.validator is not None:
            step.validator(inst, step.attribute, new)
    except Exception as exc:  # whatever a converter raises, the bytes are not a message
        raise _Bad(step.where, f"not a valid {step.where.split('.')[0]}: {exc}") from exc
    return new


def _is_mapping(tp: Any) -> bool:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return typing.get_origin(tp) in (Mapping, dict)


def _runtime_kind(tp: Any) -> type[Any]:
    """The Python type msgspec decodes a union member ``tp`` into (for a union's fixer)."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    if origin in (Mapping, dict):
        return dict
    if origin is tuple:
        return tuple
    if origin is frozenset:
        return frozenset
    if tp is Any:
        return object
    return tp if isinstance(tp, type) else object


def _enum_text(tp: type[enum.Enum], where: str) -> str:
    values = [m.value for m in tp]
    kinds = {type(v) for v in values}
    if not values or not (kinds == {str} or kinds == {int}):
        raise TypeError(
            f"{where}: the codec carries enums whose values are all str or all int; "
            f"{tp.__qualname__} has values {sorted(map(repr, values))}"
        )
    return f"{tp.__qualname__}{sorted(values)!r}"


_NO_DEFAULT = object()


@attrs.frozen
class _Step:
    """What finishing one decoded field takes: its type's fixer, then its converter (skipped
    for a value equal to the default, which gets ``converted_default``), then its validator
    again when the converter changed the value."""

    name: str
    where: str
    fix: _Fix | None
    converter: Callable[[Any], Any] | None
    default: Any
    converted_default: Any
    validator: Any
    attribute: attrs.Attribute[Any]
    mapping: bool
    """The field is a ``Mapping``: an empty one becomes the shared empty FrozenDict."""

    @classmethod
    def make(
        cls, f: attrs.Attribute[Any], fix: _Fix | None, where: str, mapping: bool
    ) -> _Step | None:
        conv: Any = f.converter
        if isinstance(conv, attrs.Converter):
            wrapped: Any = conv  # attrs' stubs do not declare its attributes
            if wrapped.takes_self or wrapped.takes_field:
                raise TypeError(
                    f"{where}: converters that take self or the field are not supported"
                )
            conv = wrapped.converter
        if conv is not None and conv in _TYPE_CHECKED:
            conv = None
        if fix is None and conv is None:
            return None
        default: Any = _NO_DEFAULT
        converted: Any = _NO_DEFAULT
        declared: Any = f.default
        if conv is not None and declared is not attrs.NOTHING:
            if isinstance(declared, attrs.Factory):  # type: ignore[arg-type]
                if not declared.takes_self:
                    default = declared.factory()
            else:
                default = declared
            if default is not _NO_DEFAULT:
                try:
                    converted = conv(default)
                except Exception:
                    default = _NO_DEFAULT  # a default the converter refuses: convert always
        return cls(
            f.name, where, fix, conv, default, converted, f.validator if conv else None, f, mapping
        )


def _enc_hook(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(
        f"a {type(value).__name__} cannot be encoded: message fields hold str, int, float, bool, "
        "bytes, None, tuples, frozensets, mappings, enums and attrs values"
    )


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook, order="deterministic")
# For classes with a map whose keys are not str (msgspec sorts only str keys), and sets whose
# items do not compare (mixed kinds): iteration order. Decoding does not depend on it.
_UNORDERED = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_MAP_KEYS = re.compile(r"map\[([^,\]]+)")  # the key types in a class's layout text


def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or len(tag) > _MAX_TAG or not _TAG.fullmatch(tag):
        raise ValueError(
            f"message tag {tag!r} is not valid: use a dotted lowercase name of at most "
            f"{_MAX_TAG} characters that starts with your distribution's name, "
            "e.g. 'mypkg.metadata'"
        )


@attrs.frozen
class _Entry:
    """One registered class: its tag, envelope prefix, decoder and finishing pass."""

    cls: type[Any]
    tag: str
    prefix: bytes
    """Magic, version, tag length, tag and layout checksum: everything before the body."""
    layout: bytes
    decoder: msgspec.msgpack.Decoder[Any]
    finish: _Fix | None
    encoder: msgspec.msgpack.Encoder
    skip: int
    """``len(prefix)``: where the body starts."""


class Codec:
    """Encodes and decodes registered message types.

    ``Codec()`` knows the built-in messages (:class:`~kvframe.protocol.messages.ConnectorMetadata`
    as ``"kvframe.metadata"`` and :class:`~kvframe.protocol.messages.ConnectorOutput` as
    ``"kvframe.output"``). :meth:`with_types` returns a *new* codec that also knows a
    connector's own classes; a codec never changes after construction, so no test or plugin
    can change what another one decodes.

    ``max_message_bytes`` bounds what :meth:`decode` reads (and what :meth:`encode` produces).
    """

    __slots__ = ("_by_cls", "_by_prefix", "_by_tag", "_compiler", "_max", "_tags")

    def __init__(self, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        if type(max_message_bytes) is not int or max_message_bytes < _HEADER.size + 2:
            raise ValueError(f"max_message_bytes = {max_message_bytes!r}; it must be an int > 8")
        self._max = max_message_bytes
        self._by_tag: dict[bytes, _Entry] = {}
        self._by_cls: dict[type[Any], _Entry] = {}
        self._by_prefix: dict[bytes, _Entry] = {}
        self._tags: dict[str, type[Any]] = {}
        self._compiler = _Compiler()
        for tag, cls in _BUILTINS:
            self._add(tag, cls)

    def _add(self, tag: str, cls: type[Any]) -> None:
        if not (isinstance(cls, type) and attrs.has(cls)):
            raise TypeError(f"{cls!r} (tag {tag!r}) is not an attrs class")
        if tag in self._tags:
            raise ValueError(
                f"tag {tag!r} is already registered for {self._tags[tag].__qualname__}"
            )
        if cls in self._by_cls:
            raise ValueError(
                f"{cls.__qualname__} is already registered under tag {self._by_cls[cls].tag!r}"
            )
        finish, text = self._compiler.compile(cls, cls.__qualname__)
        try:
            decoder = msgspec.msgpack.Decoder(cls)
        except Exception as exc:
            raise TypeError(f"{cls.__qualname__}: msgspec cannot decode it: {exc}") from exc
        layout = struct.pack(">I", zlib.crc32(text.encode()))
        tag_bytes = tag.encode("ascii")
        prefix = _HEADER.pack(MAGIC, PROTOCOL_VERSION, len(tag_bytes)) + tag_bytes + layout
        keys = _MAP_KEYS.findall(text)
        encoder = _ENCODER if all(k == "str" or k.startswith("str@") for k in keys) else _UNORDERED
        entry = _Entry(cls, tag, prefix, layout, decoder, finish, encoder, len(prefix))
        self._by_tag[tag_bytes] = entry
        self._by_cls[cls] = entry
        self._by_prefix[prefix] = entry
        self._tags[tag] = cls

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
        for tag, cls in self._tags.items():
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
        return types.MappingProxyType(self._tags)

    @property
    def max_message_bytes(self) -> int:
        """The size limit of one encoded message."""
        return self._max

    def encode(self, message: object) -> bytes:
        """The envelope bytes for ``message``.

        The message's exact class must be registered (a subclass is not encoded as its base:
        that would drop its fields). Raises ``TypeError`` for an unregistered class or a field
        holding a value msgspec cannot write (an object that is no message value, an int over
        64 bits), and ``ValueError`` when the result would exceed ``max_message_bytes``.
        Nothing is returned then. A field holding a writable value of another type than
        declared (a ``str`` where an ``int`` is declared) is not checked here: the decoder
        refuses it with a :class:`~kvframe.errors.CodecError` naming the field.
        """
        cls = type(message)
        entry = self._by_cls.get(cls)
        if entry is None:
            raise TypeError(
                f"{cls.__qualname__} is not registered with this codec; "
                "register it with codec.with_types({'yourpkg.name': cls})"
            )
        try:
            body = entry.encoder.encode(message)
        except TypeError as exc:
            if "not supported between" not in str(exc):
                raise TypeError(f"cannot encode {cls.__qualname__}: {exc}") from exc
            body = self._unordered(message)
        except (OverflowError, ValueError, msgspec.EncodeError) as exc:
            raise TypeError(f"cannot encode {cls.__qualname__}: {exc}") from exc
        if len(body) + entry.skip > self._max:
            raise ValueError(
                f"encoded {cls.__qualname__} is {len(body) + entry.skip} bytes, over the "
                f"limit of {self._max}; split the work over several steps or raise "
                "max_message_bytes"
            )
        return entry.prefix + body

    @staticmethod
    def _unordered(message: object) -> bytes:
        try:
            return _UNORDERED.encode(message)
        except (TypeError, OverflowError, ValueError, msgspec.EncodeError) as exc:
            raise TypeError(f"cannot encode {type(message).__qualname__}: {exc}") from exc

    def envelope(self, tag: str, body: bytes) -> bytes:
        """``body`` in the envelope of the registered ``tag`` (this version, the class's
        layout checksum): how tests write malformed bodies by hand. Raises ``KeyError`` for
        an unregistered tag."""
        return self._by_tag[tag.encode("ascii")].prefix + body

    def decode(self, data: bytes | bytearray | memoryview) -> object:
        """The message encoded in ``data``.

        Raises :class:`~kvframe.errors.UnsupportedVersionError` for a protocol version not in
        :data:`SUPPORTED_VERSIONS`, :class:`~kvframe.errors.UnknownMessageTypeError` for an
        unregistered tag, and :class:`~kvframe.errors.CodecError` for anything else wrong (bad
        magic, truncation, oversize, trailing bytes, another layout of the class, a field of
        the wrong type, a value the message class rejects); the message names what was wrong.
        Raises ``TypeError`` only when ``data`` is not bytes-like at all.
        """
        if type(data) is not bytes:
            if not isinstance(data, (bytearray, memoryview)):
                raise TypeError(f"decode() takes bytes, got {type(data).__name__}")
            data = bytes(data)
        size = len(data)
        if size > self._max:
            raise CodecError(f"message is {size} bytes, over the limit of {self._max}")
        # One look-up checks magic, version, tag and layout at once; a miss is diagnosed.
        try:
            entry = self._by_prefix[data[: _HEADER.size + _LAYOUT + data[6]]]
        except (KeyError, IndexError):
            raise self._diagnose(data) from None
        body = data[entry.skip :] if size < 4096 else memoryview(data)[entry.skip :]
        try:
            result: object = entry.decoder.decode(body)
            if entry.finish is not None:
                entry.finish(result)
        except _Bad as exc:  # the finishing pass: a converter or a plain value refused it
            raise CodecError(f"malformed {entry.tag}: {exc}") from exc
        except RecursionError as exc:
            raise CodecError(f"malformed {entry.tag}: nested too deeply") from exc
        except Exception as exc:
            # msgspec's DecodeError (not msgpack, wrong type, missing field, trailing bytes)
            # or whatever the class's validators or __attrs_post_init__ raise.
            raise CodecError(
                f"malformed {entry.tag}: not a valid {entry.cls.__qualname__}: {exc}"
            ) from exc
        return result

    def _diagnose(self, data: bytes) -> CodecError:
        """Why ``data`` does not start with the prefix of a registered class."""
        size = len(data)
        if size < _HEADER.size:
            return CodecError(f"message is {size} bytes, shorter than the 7-byte header")
        magic, version, tag_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            return CodecError(f"bad magic {magic!r}; expected {MAGIC!r} (not a kvframe message)")
        if version not in SUPPORTED_VERSIONS:
            return UnsupportedVersionError(
                f"protocol version {version}; this side reads {sorted(SUPPORTED_VERSIONS)}. "
                "Run the same kvframe version in the scheduler and every worker"
            )
        end = _HEADER.size + tag_len
        if tag_len == 0 or size < end:
            return CodecError(f"truncated or empty type tag (length {tag_len})")
        entry = self._by_tag.get(data[_HEADER.size : end])
        if entry is None:
            try:
                tag = data[_HEADER.size : end].decode("ascii")
            except UnicodeDecodeError:
                return CodecError("type tag is not ASCII")
            return UnknownMessageTypeError(
                f"unknown message type {tag!r}; this codec knows {sorted(self._tags)}"
            )
        if size < end + _LAYOUT:
            return CodecError(f"{entry.tag}: truncated before the layout checksum")
        return CodecError(
            f"{entry.tag}: the sender's {entry.cls.__qualname__} has another layout (fields or "
            "field types differ). Run the same code in the scheduler and every worker"
        )

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
