"""Turning a config that fails validation into a ConfigError that names the key, the value
and the fix.

Pydantic reports problems by location; a cross-key check raises `KeyProblem` to say which
key it is about, and an unknown key gets the closest known one suggested (typos are the usual
cause).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ocrvl_daemon.errors import ConfigError, ConfigProblemsError


class KeyProblem(ValueError):
    """A cross-key problem found after the sections validated; carries the key it is about."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.value = value
        self.message = message


class KeyProblems(ValueError):
    """Several cross-key problems found at once."""

    def __init__(self, problems: list[KeyProblem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems


def config_error(exc: ValidationError, model: type[BaseModel], source: Path | None) -> ConfigError:
    """Every problem of `exc` (validating `model`, read from `source`) for the user: one
    ConfigError, or a ConfigProblemsError gathering them all."""
    where = f" in {source}" if source else ""
    problems = list(_each_problem(exc, model, ""))
    if len(problems) > 1:
        return ConfigProblemsError(problems, where)
    return next(_each_problem(exc, model, where))


def _each_problem(exc: ValidationError, model: type[BaseModel],
                  where: str) -> Iterator[ConfigError]:
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, KeyProblems):
            yield from (_key_problem(problem, where) for problem in cause.problems)
        elif isinstance(cause, KeyProblem):
            yield _key_problem(cause, where)
        else:
            yield _field_problem(err, model, where)


def _key_problem(problem: KeyProblem, where: str) -> ConfigError:
    return ConfigError(f"Config key {problem.key} = {problem.value!r}{where}: {problem.message}.")


def _field_problem(err: ErrorDetails, model: type[BaseModel], where: str) -> ConfigError:
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
