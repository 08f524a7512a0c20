"""The reference of every config key of the jobs, generated from the config dataclasses: their
fields (key, type, default), the comment after a field, and each section's docstring.

    python -m rstar2_jax.config_reference > docs/config.md

docs/config.md is this module's output; a test fails when it is not current.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing

from omegaconf import MISSING

from rstar2_jax.train.configs import EvalConfig, RLJobConfig, SFTConfig

JOBS = {"sft": SFTConfig, "rl": RLJobConfig, "eval": EvalConfig}

_HEADER = """# Config reference

Every key a job reads, generated from the config dataclasses by
`python -m rstar2_jax.config_reference > docs/config.md` (a test checks this page is current).
Set a key in a YAML file (`--config file.yaml`, nested mappings) or on the command line
(`section.key=value`); an unknown key, a value of the wrong type or out of range stops the job
before any work, with a message naming the key. Every number is >= 0, and a float is finite
(at most 3.4e38) but where its note says what `inf` means. A default of *required* must be given.
The `hard-subset` command reads the `rl` job's config and its `hard_subset` section; the toy's
`demo` job has its own settings (docs/toy.md).
"""


def _comments(cls: type) -> dict[str, str]:
    """The comment after each field's declaration in ``cls``'s source."""
    found = {}
    for line in inspect.getsource(cls).splitlines():
        match = re.match(r"\s+(\w+): .*?#\s*(.+)$", line)
        if match:
            found[match.group(1)] = match.group(2).strip()
    return found


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    text = str(tp).replace("typing.", "")
    return re.sub(r"\b(\w+\.)+(\w+)", r"\2", text)


def _default(field: dataclasses.Field) -> str:
    if field.default is MISSING or (field.default is dataclasses.MISSING
                                    and field.default_factory is dataclasses.MISSING):
        return "*required*"
    value = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    return "section" if dataclasses.is_dataclass(value) else f"`{value!r}`"


def _sections(cls: type) -> list[tuple[str, type]]:
    """``(key, dataclass)`` of each field of ``cls`` that is a section (a dataclass, or an
    optional one)."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        inner = [t for t in (hints[field.name], *typing.get_args(hints[field.name]))
                 if dataclasses.is_dataclass(t)]
        if inner:
            found.append((field.name, inner[0]))
    return found


def _table(cls: type) -> list[str]:
    hints, comments = typing.get_type_hints(cls), _comments(cls)
    rows = ["| key | type | default | note |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        kind = _type_name(hints[field.name]).replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{kind}` | {_default(field)} | {comments.get(field.name, '')} |")
    return rows


def render() -> str:
    """docs/config.md: each job's top-level keys, then each section (a dataclass) once, with
    its docstring and keys, and where it appears."""
    out, used = [_HEADER], {}
    for job, schema in JOBS.items():
        out += [f"## `{job}` ({schema.__name__})", "", inspect.cleandoc(schema.__doc__ or ""), "",
                *_table(schema), ""]
        stack = [(name, cls) for name, cls in _sections(schema)]
        while stack:
            key, cls = stack.pop(0)
            used.setdefault(cls, {}).setdefault(key, []).append(f"`{job}`")
            stack += [(f"{key}.{name}", inner) for name, inner in _sections(cls)]
    out += ["## Sections", ""]
    for cls, places in used.items():
        where = "; ".join(f"`{key}` in {', '.join(jobs)}" for key, jobs in places.items())
        out += [f"### {cls.__name__}", "", f"Keys under {where}.", "",
                inspect.cleandoc(cls.__doc__ or ""), "", *_table(cls), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
