"""application/vnd.kubernetes.protobuf for the built-in kinds: upstream's own messages (k8s.io/api's
generated.proto, compiled by proto/generate.py into kubernetes.binpb) mapped to and from the JSON the store holds.

On the wire an object is the magic "k8s\\x00" and a runtime.Unknown whose typeMeta names it and whose raw bytes
are the message; the message has no apiVersion/kind of its own. The mapping follows Kubernetes' JSON: Time and
MicroTime are RFC 3339 strings, Quantity a string, IntOrString an int or a string, RawExtension and FieldsV1
embedded JSON, bytes base64, and an embedded Go struct (`json:""`) spreads its fields into its parent. Go
writes every non-pointer field, zero or not, so a zero scalar is kept only where the Go field is a pointer.
"""

from __future__ import annotations

import base64
import datetime
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from .errors import ApiError

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"
_HERE = Path(__file__).resolve().parent
_META = "k8s.io.apimachinery.pkg.apis.meta.v1"
_UNKNOWN = "k8s.io.apimachinery.pkg.runtime.Unknown"
# Kinds of meta.k8s.io/v1 that any group's clients send or receive under their own apiVersion.
_META_KINDS = frozenset({"Status", "DeleteOptions", "WatchEvent", "Table", "PartialObjectMetadata"})


@cache
def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for file in descriptor_pb2.FileDescriptorSet.FromString((_HERE / "kubernetes.binpb").read_bytes()).file:
        pool.Add(file)
    return pool


class _GoFields:
    """What upstream's Go types say about fields (proto/kubernetes/go_fields.py): "package.Message.field" keys."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.pointers = frozenset(table["pointers"])
        self.json_names: dict[str, str] = table["json_names"]
        self.inline = frozenset(table["inline"])


@cache
def _go() -> _GoFields:
    return _GoFields(json.loads((_HERE / "kubernetes_fields.json").read_text()))


def _json_name(owner: Any, field: Any) -> str:
    return str(_go().json_names.get(f"{owner.full_name}.{field.name}", field.name))


def _inline(owner: Any, field: Any) -> bool:
    return f"{owner.full_name}.{field.name}" in _go().inline


def _message(full_name: str) -> type[Message]:
    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(full_name))


def message_name(api_version: str, kind: str) -> str | None:
    """The message of a kind, or None where upstream's protos (as vendored here) have none."""
    group, _, version = api_version.rpartition("/")
    candidates = [f"{_META}.{kind}"] if kind in _META_KINDS else []
    package = "core" if not group else group.split(".")[0]
    candidates.append(f"k8s.io.api.{package}.{version}.{kind}")
    for name in candidates:
        try:
            _pool().FindMessageTypeByName(name)
        except KeyError:
            continue
        return name
    return None


def accepts(accept: str) -> bool:
    """Whether the client's first choice (by order, as client-go lists it) is protobuf."""
    first = accept.split(",", maxsplit=1)[0].split(";", maxsplit=1)[0].strip()
    return first == MEDIA_TYPE


# Decoding: bytes -> the JSON dict the store keeps.


def decode(raw: bytes) -> dict[str, Any]:
    """An enveloped object as JSON, apiVersion and kind included; a clear 400 when it is not one."""
    if not raw.startswith(MAGIC):
        raise ApiError(400, "the protobuf body does not start with the Kubernetes envelope (k8s\\x00)")
    try:
        unknown = _message(_UNKNOWN).FromString(raw[len(MAGIC) :])
    except DecodeError as exc:
        raise ApiError(400, f"the protobuf body is not a runtime.Unknown: {exc}") from None
    api_version, kind = unknown.typeMeta.apiVersion, unknown.typeMeta.kind  # type: ignore[attr-defined]
    name = message_name(api_version, kind)
    if name is None:
        raise ApiError(415, f"the server has no protobuf encoding for {api_version}, Kind={kind}")
    try:
        message = _message(name).FromString(unknown.raw)  # type: ignore[attr-defined]
    except DecodeError as exc:
        raise ApiError(400, f"the protobuf body is not a valid {kind}: {exc}") from None
    return {"apiVersion": api_version, "kind": kind, **_to_json(message)}


def _to_json(message: Message) -> dict[str, Any]:
    descriptor = message.DESCRIPTOR
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        if _inline(descriptor, field):
            out.update(_to_json(value))
            continue
        converted = _field_to_json(descriptor, field, value)
        if converted is not _OMIT:
            out[_json_name(descriptor, field)] = converted
    return out


_OMIT = object()


def _field_to_json(owner: Any, field: Any, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {k: _value_to_json(value_field, v) for k, v in value.items()}
    if field.is_repeated:
        return [_value_to_json(field, v) for v in value]
    converted = _value_to_json(field, value)
    if field.message_type is None and not converted and f"{owner.full_name}.{field.name}" not in _go().pointers:
        return _OMIT  # Go's zero of a non-pointer field, which its JSON leaves out
    return converted  # a zero Time or RawExtension written on the wire is JSON's null, as Go writes it


def _value_to_json(field: Any, value: Any) -> Any:
    if field.message_type is None:
        if field.type == FieldDescriptor.TYPE_BYTES:
            return base64.b64encode(value).decode()
        return value
    special = _SPECIAL_TO_JSON.get(field.message_type.full_name)
    return special(value) if special else _to_json(value)


def _time_to_json(value: Any, micro: bool = False) -> str | None:
    if not value.ListFields():
        return None  # Go's zero time, which JSON writes as null
    stamp = datetime.datetime.fromtimestamp(value.seconds, datetime.UTC)
    if micro:
        stamp = stamp.replace(microsecond=value.nanos // 1000)
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _int_or_string_to_json(value: Any) -> int | str:
    return str(value.strVal) if value.type == 1 else int(value.intVal)


def _raw_json(raw: bytes) -> Any:
    return json.loads(raw) if raw else None


_SPECIAL_TO_JSON: dict[str, Any] = {
    f"{_META}.Time": _time_to_json,
    f"{_META}.MicroTime": lambda v: _time_to_json(v, micro=True),
    f"{_META}.Duration": lambda v: _go_duration(v.duration),
    f"{_META}.FieldsV1": lambda v: _raw_json(v.Raw),
    "k8s.io.apimachinery.pkg.runtime.RawExtension": lambda v: _raw_json(v.raw),
    "k8s.io.apimachinery.pkg.api.resource.Quantity": lambda v: v.string,
    "k8s.io.apimachinery.pkg.util.intstr.IntOrString": _int_or_string_to_json,
}


# Encoding: the store's JSON -> bytes.


def encode(obj: dict[str, Any]) -> bytes:
    """An object (apiVersion and kind set) in the envelope; ValueError where its kind has no message."""
    api_version, kind = obj.get("apiVersion") or "", obj.get("kind") or ""
    name = message_name(api_version, kind)
    if name is None:
        raise ValueError(f"no protobuf message for {api_version}, Kind={kind}")
    message = _message(name)()
    _from_json(message, {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")})
    unknown = _message(_UNKNOWN)()
    unknown.typeMeta.apiVersion = api_version  # type: ignore[attr-defined]
    unknown.typeMeta.kind = kind  # type: ignore[attr-defined]
    unknown.raw = message.SerializeToString(deterministic=True)  # type: ignore[attr-defined]
    return MAGIC + unknown.SerializeToString(deterministic=True)


def encodable(obj: Any) -> bool:
    return isinstance(obj, dict) and message_name(obj.get("apiVersion") or "", obj.get("kind") or "") is not None


def _from_json(message: Message, data: dict[str, Any]) -> None:
    descriptor = message.DESCRIPTOR
    for field in descriptor.fields:
        if _inline(descriptor, field):
            inner = {k: v for k, v in data.items() if k in _json_names(field.message_type)}
            if inner:
                _from_json(getattr(message, field.name), inner)
            continue
        value = data.get(_json_name(descriptor, field))
        if value is None:
            continue
        target = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_field.message_type is None:
                    target[key] = _scalar(value_field, item)
                else:
                    _set_message(target[key], value_field, item)
        elif field.is_repeated:
            for item in value:
                if field.message_type is None:
                    target.append(_scalar(field, item))
                else:
                    _set_message(target.add(), field, item)
        elif field.message_type is None:
            setattr(message, field.name, _scalar(field, value))
        else:
            _set_message(target, field, value)


def _json_names(descriptor: Any) -> frozenset[str]:
    """The JSON keys a message's fields take, an embedded struct's (which may embed another) included."""
    names: set[str] = set()
    for field in descriptor.fields:
        if _inline(descriptor, field):
            names |= _json_names(field.message_type)
        else:
            names.add(_json_name(descriptor, field))
    return frozenset(names)


def _scalar(field: Any, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64decode(value)
    return value


def _set_message(target: Message, field: Any, value: Any) -> None:
    special = _SPECIAL_FROM_JSON.get(field.message_type.full_name)
    if special is not None:
        special(target, value)
    else:
        _from_json(target, value)
        target.SetInParent()


def _time_from_json(target: Any, value: str) -> None:
    stamp = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    target.seconds = int(stamp.timestamp())
    target.nanos = stamp.microsecond * 1000


def _int_or_string_from_json(target: Any, value: int | str) -> None:
    if isinstance(value, str):
        target.type, target.strVal = 1, value
    else:
        target.type, target.intVal = 0, value


def _raw_from_json(target: Any, attribute: str, value: Any) -> None:
    setattr(target, attribute, json.dumps(value, separators=(",", ":")).encode())


_SPECIAL_FROM_JSON: dict[str, Any] = {
    f"{_META}.Time": _time_from_json,
    f"{_META}.MicroTime": _time_from_json,
    f"{_META}.Duration": lambda t, v: setattr(t, "duration", _parse_go_duration(v)),
    f"{_META}.FieldsV1": lambda t, v: _raw_from_json(t, "Raw", v),
    "k8s.io.apimachinery.pkg.runtime.RawExtension": lambda t, v: _raw_from_json(t, "raw", v),
    "k8s.io.apimachinery.pkg.api.resource.Quantity": lambda t, v: setattr(t, "string", str(v)),
    "k8s.io.apimachinery.pkg.util.intstr.IntOrString": _int_or_string_from_json,
}


# Go's time.Duration text ("1h2m3.5s"), for metav1.Duration.

_UNITS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)")


def _parse_go_duration(text: str) -> int:
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-")
    parts = _DURATION_PART.findall(body)
    if body != "0" and "".join(n + u for n, u in parts) != body:
        raise ApiError(400, f"invalid duration {text!r}")
    return sign * round(sum(float(n) * _UNITS[u] for n, u in parts))


def _go_duration(nanos: int) -> str:
    if nanos == 0:
        return "0s"
    sign, nanos = ("-" if nanos < 0 else ""), abs(nanos)
    hours, rest = divmod(nanos, 3600 * 10**9)
    minutes, rest = divmod(rest, 60 * 10**9)
    seconds = f"{rest / 10**9:.9f}".rstrip("0").rstrip(".")
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{seconds}s"
    return sign + text
