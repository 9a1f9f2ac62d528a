"""Configuration: every mistake is caught before anything starts, naming key, value and fix."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from ocrvl_daemon.config.file import load_config, validate_config
from ocrvl_daemon.config.models import (
    DEFAULT_MAX_NEW_TOKENS,
    IMAGE_TOKEN_BUDGET,
    PROMPT_TOKEN_BUDGET,
)
from ocrvl_daemon.errors import ConfigError, ExitCode
from ocrvl_daemon.server import gpu, layout_engine
from ocrvl_daemon.server.placement import decide_placement
from testkit.documents import make_pdf
from testkit.harness import free_port, start_fake_server
from testkit.runner import ocrvl_argv, ocrvl_env, run_ocrvl, write_config

MIN_LEN = DEFAULT_MAX_NEW_TOKENS + IMAGE_TOKEN_BUDGET + PROMPT_TOKEN_BUDGET

BAD_CONFIGS = [
    pytest.param(
        {"inbox": {"stabel_seconds": 1}},
        ["inbox.stabel_seconds", "did you mean inbox.stable_seconds"],
        id="typo in a key",
    ),
    pytest.param({"modle": {}}, ["'modle'", "did you mean model"], id="typo in a section"),
    pytest.param(
        {"model": {"name": "PaddleOCR-VL-2"}},
        ["model.name", "'PaddleOCR-VL-2'", "PaddleOCR-VL-1.6-0.9B"],
        id="unknown model",
    ),
    pytest.param(
        {"server": {"vllm_args": {"max-model-len": 4110}}},
        ["server.vllm_args.max-model-len", "4110", f"at least {MIN_LEN}"],
        id="max-model-len too small for the requests",
    ),
    pytest.param(
        {"model": {"max_new_tokens": 8192}, "server": {"vllm_args": {"max_model_len": 8192}}},
        ["max-model-len", f"at least {8192 + MIN_LEN - DEFAULT_MAX_NEW_TOKENS}"],
        id="max-model-len too small for max_new_tokens",
    ),
    pytest.param(
        {"model": {"served_name": "PaddlePaddle/PaddleOCR-VL-1.6"},
         "server": {"launcher": "genai_server"}},
        ["model.served_name", "'PaddlePaddle/PaddleOCR-VL-1.6'", "server.launcher: vllm"],
        id="served name with a launcher that cannot serve under it",
    ),
    pytest.param({"server": {"port": 70000}}, ["server.port", "70000", "65535"], id="bad port"),
    pytest.param({"server": {"port": "http"}}, ["server.port", "'http'"], id="port not a number"),
    pytest.param(
        {"server": {"launcher": "command"}},
        ["server.command", "launcher is 'command'"],
        id="command launcher without command",
    ),
    pytest.param(
        {"server": {"mode": "external"}},
        ["server.url", "mode is 'external'"],
        id="external mode without url",
    ),
    pytest.param({"server": {"url": "localhost:8000"}}, ["server.url", "http://"], id="url scheme"),
    pytest.param(
        {"server": {"vllm_args": {"gpu-memory-utilization": 1.5}}},
        ["gpu-memory-utilization", "1.5", "fraction"],
        id="utilization above 1",
    ),
    pytest.param(
        {"pipeline": {"max_concurrency": 0}},
        ["pipeline.max_concurrency", "0"],
        id="zero concurrency",
    ),
    pytest.param({"pipeline": {"workers": 0}}, ["pipeline.workers", "0", "auto or 1 to 64"],
                 id="no engine worker"),
    pytest.param({"pipeline": {"workers": "many"}}, ["pipeline.workers", "'many'", "auto"],
                 id="engine workers neither auto nor a number"),
    pytest.param({"pipeline": {"layout_device": "cuda:0"}},
                 ["pipeline.layout_device", "'cuda:0'", "auto, cpu, gpu or gpu:N"],
                 id="layout device CUDA spells"),
    pytest.param({"pipeline": {"device": "gpu0"}}, ["pipeline.device", "'gpu0'", "gpu:N"],
                 id="older device key, same rule"),
    pytest.param({"pipeline": {"layout_engine": "torch"}},
                 ["pipeline.layout_engine", "'torch'", "transformers", "[gpu-layout]"],
                 id="layout engine by its library's name"),
    pytest.param({"pipeline": {"device": "cpu", "layout_device": "gpu"}},
                 ["pipeline.device", "'cpu'", "layout_device (gpu)", "remove it"],
                 id="device and layout_device disagree"),
]


@pytest.mark.quick
@pytest.mark.parametrize(("data", "expected"), BAD_CONFIGS)
def test_config_error_names_key_value_and_fix(data, expected):
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    message = str(caught.value)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} missing from: {message}"


@pytest.mark.quick
def test_every_problem_of_a_config_is_reported_at_once():
    data = {"inbox": {"stabel_seconds": 1}, "server": {"port": 70000}}
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    messages = [p.message for p in caught.value.problems]
    assert len(messages) == 2, messages
    assert "inbox.stabel_seconds" in messages[0] and "server.port" in messages[1], messages
    assert "inbox.stable_seconds" in str(caught.value) and "65535" in str(caught.value)
    # Problems between keys are found once each key is valid: all of them too.
    with pytest.raises(ConfigError) as caught:
        validate_config({"server": {"mode": "external", "mps": "on", "replicas": 2}})
    keys = " ".join(p.message for p in caught.value.problems)
    for key in ("server.url", "server.mps", "server.replicas"):
        assert key in keys, f"{key} not reported: {caught.value}"


@pytest.mark.quick
def test_defaults_are_the_documented_contract():
    config = validate_config({})
    assert config.inbox.paths == [Path("~/ocr-inbox").expanduser()]
    assert config.inbox.stable_seconds == 2 and config.inbox.polling == "auto"
    assert config.model.name == "PaddleOCR-VL-1.6-0.9B"
    assert config.model.vl_model.pipeline_version == "v1.6"
    assert config.server.mode == "managed" and config.server.launcher == "vllm"
    assert config.server.port == 8118 and config.server.host == "127.0.0.1"
    assert config.server.vllm_args == {
        "gpu-memory-utilization": "auto",
        "max-model-len": "auto",
        "max-num-seqs": "auto",
    }
    assert config.state_dir == Path("~/.local/state/ocrvl").expanduser()


@pytest.mark.quick
@pytest.mark.parametrize(("cores", "workers", "with_cpu_layout"),
                         [(1, 1, 1), (2, 1, 1), (8, 2, 3), (16, 4, 6), (64, 4, 8)])
def test_auto_engine_workers_follow_the_cores_and_where_the_layout_model_runs(
    monkeypatch, cores, workers, with_cpu_layout):
    monkeypatch.setattr(layout_engine, "cpu_count", lambda: cores)
    monkeypatch.setattr(layout_engine, "installed_engines",
                        lambda: layout_engine.Installed(frozenset({"paddle"}), frozenset()))
    monkeypatch.setattr(gpu, "read_gpus", lambda: [])
    # Layout off (or on the GPU): a quarter of the cores, 1 to 4.
    off = {"pipeline": {"use_layout_detection": False}}
    assert decide_placement(validate_config(off)).workers == workers
    # Layout on the CPU: a worker per 2 of three quarters of the cores, up to 8.
    assert decide_placement(validate_config({})).workers == with_cpu_layout
    assert decide_placement(validate_config({"pipeline": {"workers": 3}})).workers == 3


@pytest.mark.quick
def test_sections_compare_by_their_values_alone():
    # A reload compares the old and new sections to decide what to restart; the pipeline's
    # link to its whole config (for `auto` workers) must not take part, nor recurse.
    assert validate_config({}) == validate_config({})
    assert validate_config({}).pipeline == validate_config({}).pipeline
    assert validate_config({}).pipeline != validate_config({"pipeline": {"workers": 2}}).pipeline


@pytest.mark.quick
def test_pages_are_stored_under_the_model_alone_by_default_else_with_what_differs():
    name = validate_config({}).model.name
    assert validate_config({}).recipe.key == name, "stores from before the recipe lost their pages"
    keys = {validate_config({"pipeline": {option: not default}}).recipe.key
            for option, default in [("use_layout_detection", True),
                                    ("use_doc_orientation_classify", False),
                                    ("use_doc_unwarping", False),
                                    ("use_chart_recognition", False)]}
    assert keys == {f"{name} (whole pages)", f"{name} (page orientation)",
                    f"{name} (unwarping)", f"{name} (charts)"}, keys
    assert validate_config({"pipeline": {"workers": 3}}).recipe.key == name, (
        "a setting that does not change the answers changed where pages are stored")


@pytest.mark.quick
def test_layout_device_and_engine_are_normalised_and_device_is_their_older_name():
    config = validate_config({"pipeline": {"layout_device": "GPU:1", "layout_engine": "paddle"}})
    assert config.pipeline.layout_device == "gpu:1"
    assert config.pipeline.wanted_layout_device == "gpu:1"
    assert validate_config({}).pipeline.wanted_layout_device == "auto"
    older = validate_config({"pipeline": {"device": "cpu"}})
    assert older.pipeline.wanted_layout_device == "cpu"
    both = validate_config({"pipeline": {"device": "gpu:0", "layout_device": "gpu:0"}})
    assert both.pipeline.wanted_layout_device == "gpu:0"


@pytest.mark.quick
def test_model_name_decides_the_pipeline_version():
    for name, version in [("PaddleOCR-VL-0.9B", "v1"), ("PaddleOCR-VL-1.5-0.9B", "v1.5")]:
        assert validate_config({"model": {"name": name}}).model.vl_model.pipeline_version == version


@pytest.mark.quick
def test_a_section_whose_keys_are_all_commented_out_holds_its_defaults(tmp_path):
    """Editing config.example.yaml by commenting keys out leaves `pipeline:` with nothing
    under it: that reads as the section's defaults, not as an error."""
    path = tmp_path / "config.yaml"
    path.write_text("pipeline:\n  # use_layout_detection: true\nserver:\n  vllm_args:\n"
                    "    # max-num-seqs: auto\n  env:\nhooks:\n", encoding="utf-8")
    config, _ = load_config(path, {"hooks.timeout": 30})  # as `convert --server-url` does
    assert config.pipeline == validate_config({}).pipeline
    assert config.server.vllm_args == validate_config({}).server.vllm_args
    assert config.server.env == {} and config.hooks.timeout == 30


@pytest.mark.quick
def test_home_and_env_vars_are_expanded_in_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("BOOKS", str(tmp_path))
    config = validate_config({"inbox": {"paths": ["$BOOKS/in", "~/x"]}, "state_dir": "$BOOKS/s"})
    assert config.inbox.paths == [tmp_path / "in", Path.home() / "x"]
    assert config.state_dir == tmp_path / "s"


@pytest.mark.quick
def test_lookup_order_flag_then_env_then_home_then_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OCRVL_CONFIG", raising=False)
    assert load_config(None)[1] is None
    (tmp_path / ".config/ocrvl").mkdir(parents=True)
    home = write_config(tmp_path / ".config/ocrvl/config.yaml", log_level="DEBUG")
    assert load_config(None)[1] == home
    env = write_config(tmp_path / "env.yaml", log_level="WARNING")
    monkeypatch.setenv("OCRVL_CONFIG", str(env))
    assert load_config(None)[0].log_level == "WARNING"
    flag = write_config(tmp_path / "flag.yaml", log_level="ERROR")
    assert load_config(flag)[0].log_level == "ERROR"


def test_cli_refuses_a_bad_config_before_starting_anything(tmp_path):
    config = write_config(tmp_path / "config.yaml", server={"launcher": "command"})
    pdf = tmp_path / "book.pdf"
    pdf.write_bytes(b"%PDF-1.4")
    result = run_ocrvl("convert", "--config", config, pdf, timeout=60)
    assert result.returncode == ExitCode.CONFIG
    assert "server.command" in result.stderr
    assert not (tmp_path / "state").exists(), "something started despite the bad config"


def test_missing_config_file_is_an_error(tmp_path):
    result = run_ocrvl("status", "--config", tmp_path / "nope.yaml", timeout=60)
    assert result.returncode == ExitCode.CONFIG
    assert "nope.yaml does not exist" in result.stderr


def run_unprivileged(*args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`ocrvl ARGS` as a user that permissions apply to (root ignores them): nobody, via
    setpriv, when the tests run as root."""
    argv = ocrvl_argv(*args)
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=ocrvl_env(**env), check=False)


@pytest.mark.parametrize("given", ["--config", "$OCRVL_CONFIG", "home"])
def test_a_config_file_in_a_folder_the_user_cannot_enter_is_a_config_error_with_the_fix(
    given: str,
):
    # Not under tmp_path: pytest keeps that closed to other users, and only `locked` may be.
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o755)
        locked = Path(root) / "locked"
        (locked / ".config" / "ocrvl").mkdir(parents=True)
        config = write_config(locked / ".config" / "ocrvl" / "config.yaml")
        locked.chmod(0o700 if os.geteuid() == 0 else 0o000)
        result = _status_as_another_user(given, config, locked)
        locked.chmod(0o755)
    assert result.returncode == ExitCode.CONFIG, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "Permission denied" in result.stderr, result.stderr
    assert f"let your user enter {locked}" in result.stderr, result.stderr


def _status_as_another_user(
    given: str, config: Path, home: Path
) -> subprocess.CompletedProcess[str]:
    if given == "--config":
        return run_unprivileged("status", "--config", config)
    if given == "home":
        return run_unprivileged("status", HOME=str(home))
    return run_unprivileged("status", OCRVL_CONFIG=str(config))


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"inbox": {"paths": ["$OCRVL_TEST_UNSET/inbox"]}}, "inbox.paths"),
        ({"state_dir": "${OCRVL_TEST_UNSET}/state"}, "state_dir"),
        ({"server": {"api_key": "$OCRVL_TEST_UNSET"}}, "server.api_key"),
        ({"server": {"python": "$OCRVL_TEST_UNSET/bin/python"}}, "server.python"),
    ],
    ids=["inbox", "state_dir", "api_key", "python"],
)
@pytest.mark.quick
def test_an_unset_variable_in_the_config_is_an_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, data: dict[str, object], key: str
):
    monkeypatch.delenv("OCRVL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as caught:
        validate_config(data)
    text = str(caught.value)
    assert key in text and "$OCRVL_TEST_UNSET is not set" in text, text
    assert "Fix: set OCRVL_TEST_UNSET" in text, text


def test_an_api_key_holding_a_dollar_reaches_the_server_as_it_is(tmp_path: Path):
    """`api_key: $KEY` is expanded once, by the daemon: a `$` inside the key itself is part of
    the key, not a variable for the engine worker to expand again (issue 50, item 2)."""
    key = "sk-a$bc"
    book = make_pdf(tmp_path / "book.pdf", 2)
    config = write_config(tmp_path / "config.yaml", server={"api_key": "$OCRVL_TEST_KEY"})
    with start_fake_server(free_port(), "--api-key", key) as server:
        result = run_ocrvl("convert", "--config", config, "--server-url", server.api_url, book,
                           OCRVL_TEST_KEY=key)
    assert "$bc is not set" not in result.stderr, (
        "the engine worker expanded the API key a second time:\n" + result.stderr[-2000:])
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert book.with_suffix(".md").read_text("utf-8").count("<!-- page ") == 2


def test_an_unset_variable_in_an_inbox_creates_no_folder_named_after_it(tmp_path: Path):
    config = write_config(tmp_path / "config.yaml",
                          inbox={"paths": ["$OCRVL_TEST_UNSET/inbox"]})
    result = run_ocrvl("run", "--config", config, timeout=60, cwd=tmp_path)
    assert result.returncode == ExitCode.CONFIG, (result.returncode, result.stderr)
    assert "$OCRVL_TEST_UNSET is not set" in result.stderr, result.stderr
    assert not (tmp_path / "$OCRVL_TEST_UNSET").exists()
