"""Errors in what a user gave a job: the config, the data, the model, the tokenizer, a path.

Each is raised with a one-line message that names the file or setting and says what to change;
the CLI prints that line and exits with status 2 (the traceback only with ``--debug``). Anything
else that escapes a job is a bug and keeps its traceback.

    UserError
    ├── ConfigError      a config file or override that does not fit the job's schema
    ├── DataError        a dataset or SFT file that is missing, empty or malformed
    ├── ModelError       a model directory that is missing, incomplete or unsupported
    ├── TokenizerError   a tokenizer that is missing or does not fit the model / chat format
    ├── MismatchError    a sampler whose log-probs are not the trainer's (temperature, weights)
    ├── NonFiniteError   updates whose loss or gradient stays NaN or infinite (settings, data)
    └── OutputError      an output path that cannot be written

They derive from ``ValueError`` (``OutputError`` from ``OSError``) so that code catching the
built-in kinds keeps working. ``require_writable_dir`` / ``require_writable_file`` check an
output location before a long job writes to it.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UserError(Exception):
    """Bad input from the user; the message is one line naming what to change."""


class ConfigError(UserError, ValueError):
    """A config file or override that does not fit the schema."""


class DataError(UserError, ValueError):
    """A dataset or SFT data file that is missing, empty or malformed."""


class ModelError(UserError, ValueError):
    """A model directory that is missing, incomplete or asks for an unsupported feature."""


class TokenizerError(UserError, ValueError):
    """A tokenizer that is missing or does not fit the model or the chat format."""


class MismatchError(UserError, ValueError):
    """The sampler's log-probs of the tokens it drew disagree with the trainer's beyond the
    configured bound (``rl.first_step_gap_limit``): a setting or the served weights differ."""


class NonFiniteError(UserError, FloatingPointError):
    """Several steps in a row whose loss or gradient was NaN or infinite (their updates were
    skipped): a learning rate or a weight that overflows, or bad data."""


class OutputError(UserError, OSError):
    """An output path that cannot be written."""


def require_writable_dir(path, what: str) -> Path:
    """Raises OutputError naming ``what`` and ``path`` unless directory ``path`` can be written:
    it exists and takes a scratch file, or its nearest existing ancestor is a directory that
    does (a permission test would pass for root on a read-only mount). Creates nothing, so a
    job can check its outputs before it starts and leave no trace when it stops early."""
    path = Path(path).absolute()
    _require_writable(path, path, what)
    return path


def require_writable_file(path, what: str) -> Path:
    """Like `require_writable_dir` for a file that will be (over)written at ``path``."""
    path = Path(path).absolute()
    if path.is_dir():
        raise OutputError(f"cannot write {what} {path}: it is a directory (give a file name)")
    _require_writable(path.parent, path, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"cannot write {what} {path}: permission denied (choose another location)")
    return path


def _require_writable(directory: Path, shown: Path, what: str) -> None:
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot write {what} {shown}: {existing} is a file, not a directory "
                          f"(choose another location)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise OutputError(f"cannot write {what} {shown}: {existing} is not writable "
                          f"({e.strerror or e}; choose another location)") from None
