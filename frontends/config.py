"""config.json: reading it, smoothing over the spellings of different transformers versions, and parsing it into
a DAG file's config dataclass with one-line errors that name the file and the key."""

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pegainfer.errors import ConfigError
from pegainfer.ir.dtypes import dtype_from_name

T = TypeVar("T")


def read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (a checkpoint folder needs a config.json)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return normalize_hf_config(raw)


def normalize_hf_config(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `dtype` and `rope_parameters`; 4.x wrote `torch_dtype`, `rope_theta`, `rope_scaling`.
    DAG files see the 4.x spelling, with a default rope_type folded to no scaling. Parameters per layer type
    (`{"full_attention": {...}, "sliding_attention": {...}}`) stay in `rope_parameters` for the DAG file to read."""
    config = dict(raw)
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and not all(isinstance(v, dict) for v in rope.values()):
        if "rope_theta" in rope:
            config.setdefault("rope_theta", rope["rope_theta"])
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", scaling)
    return config


def architecture_of(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: key 'architectures' must be a non-empty list of names, found {archs!r}")
    return archs[0]


def parse_config(cls: type[T], raw: dict[str, Any], source: str) -> T:
    """Fills the dataclass `cls` from config.json: fields without a default are required keys; each value is
    checked against the field's type (int, float, bool, str, their Optional forms, dict and list)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        has_default = field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING
        if field.name not in raw:
            if not has_default:
                raise ConfigError(f"{source}: missing key {field.name!r} ({_describe(hints[field.name])})")
            continue
        values[field.name] = _checked(raw[field.name], hints[field.name], field.name, source)
    return cls(**values)


def require_positive(config: Any, *names: str) -> None:
    """For DAG files' check_config: sizes and counts that must be at least 1."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"key {name!r} must be at least 1, found {value!r}")


def require_float_dtype(name: str) -> None:
    """For DAG files' check_config: the checkpoint's torch_dtype must be a float type the IR knows."""
    try:
        dtype = dtype_from_name(name)
    except ConfigError:
        dtype = None
    if dtype is None or not dtype.is_float:
        raise ConfigError(f"key 'torch_dtype' must be bfloat16, float16 or float32, found {name!r}")


def _checked(value: Any, hint: Any, key: str, source: str) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    for kind in allowed:
        kind = typing.get_origin(kind) or kind
        if kind is type(None) and value is None:
            return None
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (bool, str, dict, list) and isinstance(value, kind):
            return value
    raise ConfigError(f"{source}: key {key!r} must be {_describe(hint)}, found {type(value).__name__} {value!r}")


def _describe(hint: Any) -> str:
    names = [getattr(typing.get_origin(a) or a, "__name__", str(a)) for a in (typing.get_args(hint) or (hint,))]
    return " or ".join("null" if n == "NoneType" else ("an int" if n == "int" else f"a {n}") for n in names)
