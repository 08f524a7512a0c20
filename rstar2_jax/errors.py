"""Errors in what a user gave a job: the config, the data, the model, the tokenizer, a path.

Each is raised with a one-line message that names the file or setting and says what to change;
the CLI prints that line and exits with status 2 (the traceback only with ``--debug``). Anything
else that escapes a job is a bug and keeps its traceback.

    UserError
    ├── ConfigError      a config file or override that does not fit the job's schema
    ├── DataError        a dataset or SFT file that is missing, empty or malformed
    ├── ModelError       a model directory that is missing, incomplete or unsupported
    ├── TokenizerError   a tokenizer that is missing or does not fit the model / chat format
    └── OutputError      an output path that cannot be written

They derive from ``ValueError`` (``OutputError`` from ``OSError``) so that code catching the
built-in kinds keeps working.
"""
from __future__ import annotations


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


class OutputError(UserError, OSError):
    """An output path that cannot be written."""
