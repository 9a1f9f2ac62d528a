"""Config values as a user writes them, made into what they mean: `~` and `$VARS` expanded (once,
in the daemon: the values it hands on are final), folders checked, server URLs normalised."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ocrvl_daemon.errors import UnsetVariableError

# `$NAME` or `${NAME}`, as os.path.expandvars reads them.
_VARIABLE = re.compile(r"\$(?:(\w+)|\{([^}]*)\})")


def expand_vars(value: str) -> str:
    """`$VARS` replaced from the environment. An unset one raises UnsetVariableError: left
    as it is, it would become a folder named `$NOPE` or a literal API key."""

    def value_of(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in os.environ:
            raise UnsetVariableError(name)
        return os.environ[name]

    return _VARIABLE.sub(value_of, value)


def expand_path(value: str | Path) -> Path:
    """`~` and `$VARS` expanded (see `expand_vars`); relative paths stay relative to the
    working directory."""
    return Path(expand_vars(os.path.expanduser(str(value))))


def folder_problem(folder: Path) -> str | None:
    """Why this user cannot use `folder` (or create it, where it is missing); None if it can."""
    existing = folder
    # os.path.exists: a folder on the way that cannot be entered reads as missing, and its
    # parent then says why.
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    missing = "" if existing == folder else "cannot be created: "
    if not existing.is_dir():
        return f"{missing}{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{missing}{existing} is not writable for this user"
    return None



def openai_base_url(value: str) -> str:
    """`value` as an OpenAI API base URL (ending in /v1); ValueError says what it must be."""
    if not value.startswith(("http://", "https://")):
        raise ValueError("must start with http:// or https://, e.g. http://127.0.0.1:8118/v1")
    value = value.rstrip("/")
    return value if value.endswith("/v1") else value + "/v1"

