"""Load frozen dataclass configs from YAML plus ``key=value`` overrides.

The dataclass is the schema: OmegaConf checks every key and value against its fields and types
(``Literal`` choices included) before the dataclass is built, so a typo or a bad value fails with
a message naming the dotted key instead of being silently ignored. One rule then holds for every
number of every job (`check_numbers`): it is not negative, an integer fits in int64, and a float
is finite in float32, where training computes (``inf``, ``1e308`` and ``nan`` would train NaN or
nothing), but for the fields whose metadata gives infinity a meaning (``"infinity": "no
clipping"``). Ranges of particular settings live in each dataclass's ``__post_init__``.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rstar2_jax.errors import ConfigError

__all__ = ["ConfigError", "check_numbers", "config_from_dict", "config_to_dict", "config_to_yaml",
           "load_config"]

T = TypeVar("T")

_FLOAT32_MAX = 3.4028234663852886e38
_INT64_LIMIT = 2**63


def load_config(schema: type[T] | T, path: str | Path | Sequence[str | Path] | None = None,
                overrides: Sequence[str] = ()) -> T:
    """Builds ``schema`` from its defaults, then the YAML file(s) at ``path``, then ``overrides``.

    Args:
      schema: a (frozen) dataclass type, or an instance of one (a preset) whose values take the
        place of the defaults.
      path: optional YAML file whose keys mirror the dataclass fields (nested as mappings), or
        a sequence of them applied in order (a later file's values win).
      overrides: ``"a.b=value"`` strings applied last, in order.

    Raises:
      ConfigError: unknown key, wrong type, invalid choice, a number outside `check_numbers`'
        rule or a failed range check; the message names the offending key.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
    layers = [OmegaConf.structured(schema)]
    try:
        for file in _files(path):
            if not Path(file).is_file():
                raise ConfigError(f"config file {str(file)!r} does not exist")
            layers.append(OmegaConf.load(file))
        layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"required config keys not set: {', '.join(missing)}")
        check_numbers(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, path)) from None
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"invalid config{_source(path)}: {e}") from None


def config_from_dict(schema: type[T], values: dict[str, Any]) -> T:
    """Rebuilds a config saved with :func:`config_to_dict` (validated like a file)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        check_numbers(merged)
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, None)) from None


def check_numbers(node: DictConfig, prefix: str = "") -> None:
    """Raises ConfigError naming the key of the first number of ``node`` (a config as OmegaConf
    merged it, before its dataclasses' own checks) that is negative, an integer beyond int64, or
    a float that is NaN or not finite in float32, unless the field's metadata says what infinity
    means there."""
    schema = OmegaConf.get_type(node)
    metadata = {f.name: f.metadata for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    for name in node:
        value, key = node[name], f"{prefix}{name}"
        if isinstance(value, DictConfig):
            check_numbers(value, key + ".")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        infinity = metadata.get(name, {}).get("infinity")
        if math.isnan(value) or value < 0:
            raise ConfigError(f"config key {key!r}: must be a number >= 0, got {value}")
        if isinstance(value, int) and value >= _INT64_LIMIT:
            raise ConfigError(f"config key {key!r}: {value} is beyond any size or seed a run can "
                              f"use (2**63)")
        if isinstance(value, float) and value > _FLOAT32_MAX and not (value == math.inf and infinity):
            allowed = f" ({infinity}: {key}=inf)" if infinity else ""
            raise ConfigError(f"config key {key!r}: must be finite in float32 (at most 3.4e38), "
                              f"got {value}{allowed}")


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain JSON/YAML-serialisable dict of a config dataclass (tuples become lists)."""
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"expected a config dataclass, got {type(config).__name__}")
    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def config_to_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _files(path: str | Path | Sequence[str | Path] | None) -> list[str | Path]:
    return [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)


def _source(path: str | Path | Sequence[str | Path] | None) -> str:
    files = _files(path)
    return " in " + " or ".join(repr(str(file)) for file in files) if files else ""


def _describe(error: OmegaConfBaseException, path: str | Path | Sequence[str | Path] | None) -> str:
    # OmegaConf messages carry the dotted key on a separate "full_key:" line; lead with it.
    key = getattr(error, "full_key", None)
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = f"config key {key!r}" if key else "config"
    return f"{where}{_source(path)}: {first_line}"
