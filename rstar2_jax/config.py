"""Load frozen dataclass configs from YAML plus ``key=value`` overrides.

The dataclass is the schema: OmegaConf checks every key and value against its fields and types
(``Literal`` choices included) before the dataclass is built, so a typo or a bad value fails with
a message naming the dotted key instead of being silently ignored. Range checks live in each
dataclass's ``__post_init__``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rstar2_jax.errors import ConfigError

__all__ = ["ConfigError", "config_from_dict", "config_to_dict", "config_to_yaml", "load_config"]

T = TypeVar("T")


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
      ConfigError: unknown key, wrong type, invalid choice or failed range check; the message
        names the offending key.
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
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e, None)) from None


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
