"""What users read matches the code: config.example.yaml, README's commands, `--help`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ocrvl_daemon.cli import COMMANDS, build_parser
from ocrvl_daemon.config import Config, validate_config

REPO = Path(__file__).resolve().parents[1]


def _keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, dict) and key != "vllm_args" and key != "env":
            keys |= _keys(value, f"{prefix}{key}.")
    return keys


def test_config_example_lists_every_key_with_its_default():
    example = yaml.safe_load((REPO / "config.example.yaml").read_text(encoding="utf-8"))
    defaults = Config().model_dump(mode="json")
    assert _keys(example) == _keys(defaults), "config.example.yaml and the config model differ"
    assert validate_config(example).model_dump() == Config().model_dump(), \
        "a default in config.example.yaml is not the real default"


def test_readme_commands_exist_and_take_config():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `ocrvl ([a-z-]+)", readme, re.M))
    assert documented == set(COMMANDS), "README's command table and the CLI differ"
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():  # type: ignore[attr-defined]
        assert "--config" in sub.format_help(), f"`ocrvl {name}` does not take --config"


def test_readme_test_command_is_what_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = next(line.strip() for line in readme.splitlines()
                   if "pip install -e '.[test]'" in line)
    assert command in ci, ".ci/run does not run the README's test command"
