"""Strict loading of dataclasses from plain data: the one coercion config files and the artifacts between stages share.

Contract: `from_dict(cls, values, where)` builds dataclass `cls` from a mapping read from YAML or JSON, rejecting keys
it does not declare and values of the wrong type or out of the range `setting` declared, with a ConfigError (a
UserError) naming the key path. Imports only the standard library and covidxray.errors, so the contract modules
(manifest.py, run_folder.py, the edge sidecar) can use it without loading anything heavy.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import field
from typing import Any

from covidxray.errors import UserError


class ConfigError(UserError):
    """A configuration the user wrote (or a file a stage wrote) that cannot be used; the message says where and why."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    choices: tuple | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A config field with its allowed values, checked wherever a config is loaded.

    `low`/`high` are inclusive bounds, `above` an exclusive lower bound (a
    learning rate must be > 0), `choices` the only values allowed. For a mapping
    they apply to each value.
    """
    limits = {"low": low, "high": high, "above": above, "choices": choices}
    return field(default=default, default_factory=default_factory, metadata={"limits": limits})


def _check_limits(value: Any, limits: dict[str, Any], where: str) -> None:
    if isinstance(value, dict):  # a mapping's limits apply to each of its values, named by key
        for key, item in value.items():
            _check_limits(item, limits, f"{where}.{key}")
        return
    if limits["choices"] is not None and value not in limits["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, limits['choices']))}")
    if limits["low"] is not None and value < limits["low"]:
        raise ConfigError(f"{where}: {value!r} is below the minimum {limits['low']}")
    if limits["high"] is not None and value > limits["high"]:
        raise ConfigError(f"{where}: {value!r} is above the maximum {limits['high']}")
    if limits["above"] is not None and value <= limits["above"]:
        raise ConfigError(f"{where}: {value!r} must be greater than {limits['above']}")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):  # only `X | None` is declared: absent stays None, else an X
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return None if value is None else _coerce(value, kind, where)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(annotation, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(annotation)[:1] or (Any,)
        return [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        item_type = typing.get_args(annotation)[1]
        empty: dict | None = (
            {} if typing.get_origin(item_type) is dict else None
        )  # `name:` with nothing after it: no options
        return {
            str(k): _coerce(empty if v is None and empty is not None else v, item_type, f"{where}.{k}")
            for k, v in value.items()
        }
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(number, float) and not math.isfinite(
            number
        ):  # NaN passes every range check: it compares false with any limit
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected text, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type, values: dict[str, Any], where: str = "config") -> Any:
    """Build dataclass `cls` from `values`, rejecting keys it does not declare."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(values) - known))  # YAML keys may be numbers or null
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    required = [f.name for f in dataclasses.fields(cls) if _has_no_default(f)]
    absent = [name for name in required if name not in values]
    if absent:
        raise ConfigError(f"{where}: missing key(s) {', '.join(absent)}")
    kwargs = {str(k): _coerce(v, hints[str(k)], f"{where}.{k}") for k, v in values.items()}
    for spec in dataclasses.fields(cls):
        limits = spec.metadata.get("limits")
        if limits and spec.name in kwargs:
            _check_limits(kwargs[spec.name], limits, f"{where}.{spec.name}")
    return cls(**kwargs)


def _has_no_default(spec: dataclasses.Field) -> bool:
    return spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING


def foreign_version(content: dict, key: str, current: Any) -> Any | None:
    """The version a file's `content` declares under `key` when it is another than `current`, else None. A file
    without the field was written before it existed, in the first layout, which is each reader's `current` one."""
    declared = content.get(key, current)
    return None if declared == current else declared
