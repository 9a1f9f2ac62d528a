"""Turning a config that fails validation into a ConfigError that names the key, the value
and the fix.

Pydantic reports problems by location; a cross-key check raises `KeyProblem` to say which
key it is about, and an unknown key gets the closest known one suggested (typos are the usual
cause).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ocrvl_daemon.errors import ConfigError


class KeyProblem(ValueError):
    """A cross-key problem found after the sections validated; carries the key it is about."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.message = message


def config_error(exc: ValidationError, model: type[BaseModel], source: Path | None) -> ConfigError:
    """The first problem of `exc` (validating `model`, read from `source`) for the user."""
    where = f" in {source}" if source else ""
    err = exc.errors()[0]
    if isinstance(err.get("ctx", {}).get("error"), KeyProblem):
        key_err: KeyProblem = err["ctx"]["error"]
        return ConfigError(
            f"Config key {key_err.key} = {key_err.value!r}{where}: {key_err.message}."
        )
    key = ".".join(str(p) for p in err["loc"])
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        return ConfigError(
            f"Unknown config key {key!r}{where}.", _suggest_key(err["loc"], model)
        )
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # a validator's own error knows its fix
        return ConfigError(f"Config key {key} = {value!r}{where} is invalid: {cause.message}.",
                           cause.fix)
    message = err["msg"].removeprefix("Value error, ")
    return ConfigError(
        f"Config key {key} = {value!r}{where} is invalid: {message}.",
        f"see config.example.yaml for {key}'s allowed values",
    )


def _suggest_key(loc: tuple[int | str, ...], model: type[BaseModel]) -> str:
    """Name the key the user probably meant (typos are the usual cause)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            break
        model = annotation
    known = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    parent = ".".join(str(p) for p in loc[:-1])
    prefix = f"{parent}." if parent else ""
    if close:
        return f"did you mean {prefix}{close[0]}? (known keys here: {', '.join(known)})"
    return f"remove it; the known keys here are: {', '.join(known)}"
