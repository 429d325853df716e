"""The one strict config loader: YAML (or a dict) -> frozen dataclass, rejecting unknown keys and wrong types.

Errors name the source, the dotted key and the reason, e.g.
``configs/serve/cpu-local.yaml: engine.max_num_seqs: expected int, got str ('many')``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A config file or dict does not match its dataclass; the message names the source, key and reason."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file's top-level mapping, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_yaml(path: str | Path, cls: type[T]) -> T:
    """Read a YAML file into `cls`, strictly."""
    return from_dict(cls, read_yaml(path), source=str(path))


def preset_path(kind: str, name: str) -> Path:
    """`configs/<kind>/<name>.yaml`, or a clear error listing the presets that exist."""
    path = CONFIG_DIR / kind / f"{name}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))
        raise ConfigError(f"unknown {kind} preset {name!r}; have {have}")
    return path


def from_dict(cls: type[T], data: Any, source: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping. Unknown keys, missing required keys and wrong types raise ConfigError."""
    where = f"{source}: {prefix}" if prefix else f"{source}: "
    if not isinstance(data, dict):
        raise ConfigError(f"{where.rstrip(': ')}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: unknown key (allowed: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, source, f"{prefix}{name}")
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}{missing[0]}: required key is missing")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: {prefix.rstrip('.') or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict/list tree (tuples become lists), the inverse of `from_dict`."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{source}: {key}: no type of {tp} fits {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}: must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, prefix=f"{key}.")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key}: expected a list, got {type(value).__name__} ({value!r})")
        item = args[0] if args else Any
        out = [_convert(item, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}: expected float, got {type(value).__name__} ({value!r})")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}: expected int, got {type(value).__name__} ({value!r})")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise ConfigError(f"{source}: {key}: expected {tp.__name__}, got {type(value).__name__} ({value!r})")
        return value
    raise ConfigError(f"{source}: {key}: unsupported field type {tp}")
