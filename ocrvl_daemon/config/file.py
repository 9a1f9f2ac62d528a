"""Finding, reading and validating the configuration file.

Lookup order: `--config PATH`, then `$OCRVL_CONFIG`, then `~/.config/ocrvl/config.yaml`, then
the built-in defaults.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ocrvl_daemon.config.errors import config_error
from ocrvl_daemon.config.model import Config
from ocrvl_daemon.config.values import expand_path
from ocrvl_daemon.errors import ConfigError
from ocrvl_daemon.files.names import shell_quote

DEFAULT_CONFIG_PATH = Path("~/.config/ocrvl/config.yaml")
CONFIG_ENV = "OCRVL_CONFIG"


def _is_file(path: Path) -> bool:
    """Whether config file `path` is there; a folder on its way that the user cannot enter
    is a ConfigError naming it (the file may well be there: ignoring it would silently run
    on the built-in defaults)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError as exc:
        closed = next((p for p in reversed(path.parents) if not os.access(p, os.X_OK)),
                      path.parent)
        raise ConfigError(
            f"Cannot look for config file {path}: {exc.strerror} (folder {closed}).",
            f"let your user enter {closed} (e.g. `chmod u+rx {closed}` as its owner), or "
            "pass --config a file your user can read",
        ) from None


def resolve_config_path(explicit: str | Path | None) -> Path | None:
    """The config file to read, by the lookup order; None means built-in defaults."""
    if explicit:
        # The shell already expanded what it meant to; a `$` left is part of the name.
        path = Path(explicit).expanduser()
        if not _is_file(path):
            raise ConfigError(
                f"Config file {path} does not exist.",
                "pass an existing file to --config, or copy config.example.yaml there",
            )
        return path
    env = os.environ.get(CONFIG_ENV)
    if env:
        path = expand_path(env)
        if not _is_file(path):
            raise ConfigError(
                f"${CONFIG_ENV} names {path}, which does not exist.",
                f"point ${CONFIG_ENV} at an existing file, or unset it",
            )
        return path
    default = expand_path(DEFAULT_CONFIG_PATH)
    return default if _is_file(default) else None


def advice_command(command: str, config_path: Path | None) -> str:
    """`ocrvl COMMAND` as advice to paste: with `--config` when a plain one would read
    another file than `config_path`."""
    try:
        default = resolve_config_path(None)
    except ConfigError:
        default = None
    if config_path is None or config_path == default:
        return f"ocrvl {command}"
    return f"ocrvl {command} --config {shell_quote(config_path.absolute())}"


def load_config(
    explicit: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> tuple[Config, Path | None]:
    """Read, merge `overrides` (dotted keys) and validate; returns the config and its file."""
    path = resolve_config_path(explicit)
    data: Any = {}
    if path is not None:
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"Cannot read config file {path}: {exc}.",
                "check the file's permissions and encoding (UTF-8)",
            ) from exc
        except yaml.YAMLError as exc:
            raise ConfigError(
                f"Config file {path} is not valid YAML: {exc}",
                "fix the YAML syntax at the line shown",
            ) from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"Config file {path} must hold a mapping of keys, not {type(data).__name__}.",
                "start from config.example.yaml",
            )
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            if node.get(part) is None:  # a section left empty holds its defaults
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return validate_config(data, path), path


def validate_config(data: dict[str, Any], source: Path | None = None) -> Config:
    """Validate a config mapping, turning the first problem into a ConfigError naming its key."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, Config, source) from None
