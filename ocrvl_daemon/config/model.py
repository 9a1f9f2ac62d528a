"""The configuration model: every section and key, validated completely before anything starts.

`~` and `$VARS` are expanded in paths and the API key, once, here (`values`): the daemon hands
the expanded values on. Every error names the key, the bad value and the fix (worded in
`config.errors`); `config.file` finds and reads the YAML file. The `server` section is
`server_section`'s.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ocrvl_daemon.config.cluster_section import ClusterConfig
from ocrvl_daemon.config.errors import KeyProblem, KeyProblems
from ocrvl_daemon.config.layout import AUTO, ENGINES, parse_device
from ocrvl_daemon.config.models import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODEL,
    MAX_IMAGE_PIXELS,
    MODELS,
    VLModel,
)
from ocrvl_daemon.config.section import Section, named_twice
from ocrvl_daemon.config.server_section import ServerConfig
from ocrvl_daemon.config.values import expand_path, folder_problem


class InboxConfig(Section):
    """Folders watched for PDFs."""

    paths: list[Path] = Field(
        default_factory=lambda: [Path("~/ocr-inbox")], min_length=1, validate_default=True
    )
    recursive: bool = True
    stable_seconds: float = Field(2.0, ge=0)
    polling: bool | Literal["auto"] = "auto"
    poll_interval: float = Field(1.0, gt=0)
    rescan_seconds: float = Field(300.0, gt=0)
    # None: 30 s, or 10 x stable_seconds where that is longer (see watcher.bad_file_wait).
    bad_file_seconds: float | None = Field(None, gt=0)
    ignore: list[str] = Field(
        default_factory=lambda: ["*.part", "*.crdownload", "*.tmp", ".*", "~$*"]
    )

    @field_validator("paths", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, Path)) else value

    @field_validator("paths")
    @classmethod
    def _expand(cls, value: list[Path]) -> list[Path]:
        return [expand_path(p) for p in value]


class ModelConfig(Section):
    """Which PaddleOCR-VL model both the pipeline and the server use."""

    name: str = DEFAULT_MODEL
    max_new_tokens: int | None = Field(None, ge=16, le=131072)
    weights: str | None = None
    served_name: str | None = Field(None, min_length=1)

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        if value not in MODELS:
            close = difflib.get_close_matches(value, MODELS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown model; {hint}use one of {', '.join(MODELS)}")
        return value

    @property
    def served(self) -> str:
        """The name the server serves the model under and every request asks for."""
        return self.served_name or self.name

    @property
    def vl_model(self) -> VLModel:
        """The registry entry for `name`."""
        return MODELS[self.name]

    @property
    def effective_max_new_tokens(self) -> int:
        """What every page request asks for as `max_completion_tokens`."""
        return self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS


class PipelineConfig(Section):
    """PaddleOCR-VL pipeline settings and how pages are fed to it."""

    use_layout_detection: bool = True
    use_doc_orientation_classify: bool = False
    use_doc_unwarping: bool = False
    use_chart_recognition: bool = False
    # Where and on what the layout model runs (see `config.layout`); `device` is the
    # older name of layout_device, kept so that existing configs still work.
    layout_device: str = AUTO
    layout_engine: str = AUTO
    device: str | None = None
    max_concurrency: int = Field(64, ge=1, le=1024)
    min_concurrency: int = Field(4, ge=1, le=1024)
    adaptive_concurrency: bool = True
    render_scale: float = Field(2.0, gt=0, le=8)
    max_page_pixels: int = Field(25_000_000, ge=100_000)
    page_retries: int = Field(3, ge=0, le=20)
    fail_on_page_error: bool = False
    # Read answers as they stream and stop one as soon as it loops (`worker.streaming`),
    # instead of decoding it to its token limit.
    stop_loops_early: bool = True
    worker_max_pages: int = Field(2000, ge=1)
    worker_max_rss_mb: int = Field(6144, ge=256)
    # Engine worker processes (rendering, encoding, layout detection): `auto` or a number.
    workers: int | Literal["auto"] = "auto"

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == AUTO or (isinstance(value, int) and not isinstance(value, bool)
                             and 1 <= value <= 64):
            return value
        raise ValueError(f"{value!r} is not a number of engine workers; use auto or 1 to 64")

    @field_validator("layout_device", "device")
    @classmethod
    def _layout_device(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        try:
            kind, index = parse_device(value)
        except ValueError as exc:
            raise KeyProblem(f"pipeline.{info.field_name}", value, f"{exc}; auto puts the "
                             "layout model on the GPU where an engine for it is installed "
                             "and the GPU has room beside the server") from None
        return kind if index is None else f"{kind}:{index}"

    @field_validator("layout_engine")
    @classmethod
    def _layout_engine(cls, value: str) -> str:
        if value not in (AUTO, *ENGINES):
            raise KeyProblem("pipeline.layout_engine", value, "must be auto, paddle "
                             "(PaddlePaddle: the [cpu] extra, or paddlepaddle-gpu), onnxruntime "
                             "or transformers (torch: the [gpu-layout] extra)")
        return value

    @property
    def wanted_layout_device(self) -> str:
        """layout_device, or the older `device` where only that is set."""
        return self.device if self.layout_device == AUTO and self.device else self.layout_device

    @property
    def page_pixel_limit(self) -> int:
        """The most pixels a page is rendered with.

        With layout detection off the whole page is the one image sent, and the server
        shrinks anything larger to the model's input size (`MAX_IMAGE_PIXELS`), so the page
        is rendered at that size: the same input for the model, a half to a quarter of the
        pixels for ocrvl to render and encode and for the server's single API process to
        decode and resize. With layout detection on, blocks are cut from the page at full
        scale and stay that sharp.
        """
        if self.use_layout_detection:
            return self.max_page_pixels
        return min(self.max_page_pixels, MAX_IMAGE_PIXELS)

    @model_validator(mode="after")
    def _bounds(self) -> PipelineConfig:
        if self.min_concurrency > self.max_concurrency:
            raise ValueError(
                f"min_concurrency ({self.min_concurrency}) is above max_concurrency "
                f"({self.max_concurrency}); lower min_concurrency"
            )
        if self.device and self.layout_device not in (AUTO, self.device):
            raise KeyProblem("pipeline.device", self.device, f"pipeline.layout_device "
                             f"({self.layout_device}) says otherwise; device is the older name "
                             "of layout_device: remove it")
        return self


# What a hook's argv may contain; each is also in its environment as OCRVL_<NAME>.
HOOK_PLACEHOLDERS = ("pdf", "md", "json", "images", "pages", "flagged", "error")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class HooksConfig(Section):
    """Programs run after each document: argv lists, no shell, placeholders filled in."""

    on_done: list[str] | None = None
    on_failed: list[str] | None = None
    timeout: float = Field(60.0, gt=0)

    @field_validator("on_done", "on_failed")
    @classmethod
    def _hook_argv(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if value is None:
            return None
        key = f"hooks.{info.field_name}"
        if not value:
            raise KeyProblem(key, value, "is an empty list; give a command as a list, e.g. "
                            "[notify-send, ocrvl, '{pdf} is done'], or null for none")
        for arg in value:
            for name in _PLACEHOLDER.findall(arg):
                if name not in HOOK_PLACEHOLDERS:
                    known = ", ".join("{" + p + "}" for p in HOOK_PLACEHOLDERS)
                    raise KeyProblem(key, value, f"uses an unknown placeholder {{{name}}}; "
                                    f"use one of {known}")
        program = os.path.expanduser(value[0])
        if shutil.which(program) is None:
            raise KeyProblem(key, value, f"its program {value[0]!r} is not an executable found "
                            "on PATH; install it, or give its full path (a service's PATH is "
                            "shorter than a terminal's)")
        return value


class OutputConfig(Section):
    """What is written, and where."""

    # markdown: <stem>.md (always); json: also <stem>.json (pages, quality, layout blocks);
    # pdf: also <stem>.ocr.pdf (the original pages with an invisible text layer).
    # pydantic copies the default (ruff cannot tell `Section` is a pydantic model).
    formats: list[Literal["markdown", "json", "pdf"]] = ["markdown"]  # noqa: RUF012
    dir: Path | None = None
    # How a page's start is marked in the Markdown: anchor (a comment and `<a id="page-N">`,
    # inside a paragraph that runs on) or rule (`---` and the comment: each page apart).
    page_breaks: Literal["anchor", "rule"] = "anchor"
    # Book-level structure (output/book.py): tables merged and headings relevelled across pages,
    # and with page_breaks: anchor paragraphs and hyphenated words joined across them.
    restructure: bool = True

    @field_validator("formats")
    @classmethod
    def _markdown_first(cls, value: list[str]) -> list[str]:
        if "markdown" not in value:
            raise ValueError("must include markdown (the Markdown is always written); "
                             "use [markdown], or add json and/or pdf: [markdown, json, pdf]")
        return value

    @field_validator("dir")
    @classmethod
    def _writable(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        value = expand_path(value).absolute()
        problem = folder_problem(value)
        if problem is not None:
            raise KeyProblem("output.dir", str(value), f"{problem}; fix it, choose another "
                             "folder, or set null to write next to each PDF")
        return value


class MetricsConfig(Section):
    """The daemon's own Prometheus endpoint."""

    listen: str | None = None
    allow_remote: bool = False

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to listen on, or None when off."""
        if self.listen is None:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    @model_validator(mode="after")
    def _listen(self) -> MetricsConfig:
        if self.listen is None:
            return self
        host, sep, port = self.listen.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KeyProblem("metrics.listen", self.listen, "must be HOST:PORT, e.g. "
                            "127.0.0.1:9118, or null to turn the endpoint off")
        if not self.allow_remote and not _is_loopback(host):
            raise KeyProblem("metrics.listen", self.listen, "is not a loopback address, so "
                            "anyone on the network could read it; use 127.0.0.1:PORT, or "
                            "set metrics.allow_remote: true if that is what you want")
        return self


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


@dataclass(frozen=True)
class Recipe:
    """How pages are recognised, as far as their answers depend on it: the model, whether
    layout detection cuts each page into blocks (else the page is sent whole), and the
    optional steps that are on (`steps`: "page orientation", "unwarping", "charts").

    Jobs and page checkpoints are stored under `key`, so answers made another way are never
    mixed into a document or reused for it; the Markdown's header names `model`.
    """

    model: str
    layout: bool = True
    steps: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """The name jobs and pages are stored under: the model's name alone with the default
        pipeline (so stores from before the rest was part of the key stay valid), else with
        what differs, e.g. "PaddleOCR-VL-1.6-0.9B (whole pages)"."""
        parts = ([] if self.layout else ["whole pages"]) + list(self.steps)
        return f"{self.model} ({', '.join(parts)})" if parts else self.model


class Config(Section):
    """The whole ocrvl configuration."""

    inbox: InboxConfig = Field(default_factory=InboxConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    hooks: HooksConfig = Field(default_factory=HooksConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    state_dir: Path = Field(Path("~/.local/state/ocrvl"), validate_default=True)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    progress_seconds: float = Field(30.0, gt=0)

    @field_validator("state_dir")
    @classmethod
    def _expand_state(cls, value: Path) -> Path:
        return expand_path(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        # Every problem at once: fixing them one run at a time wears a user out.
        problems: list[KeyProblem] = []
        server = self.server
        if server.mode == "external" and not server.url and not server.urls:
            problems.append(KeyProblem(
                "server.url",
                None,
                "server.mode is 'external' but no url is set; "
                "set server.url: http://HOST:PORT/v1, or use server.mode: managed",
            ))
        if server.url and server.urls:
            problems.append(KeyProblem(
                "server.urls", server.urls,
                f"server.url ({server.url}) is set too; use server.url for one endpoint or "
                "server.urls for several, not both"))
        if server.mode == "managed" and server.urls:
            problems.append(KeyProblem(
                "server.urls", server.urls,
                "is for server.mode: external (servers ocrvl does not start); remove it, or "
                "set server.mode: external"))
        for key in ("replicas", "gpus"):
            if server.mode == "external" and getattr(server, key) != AUTO:
                problems.append(KeyProblem(
                    f"server.{key}", getattr(server, key),
                    "is for servers ocrvl starts (server.mode: managed); an external server's "
                    "replicas are listed in server.urls; remove it"))
        if server.mode == "external" and server.mps == "on":
            problems.append(KeyProblem(
                "server.mps", "on",
                "is for servers ocrvl starts (server.mode: managed); an external server's MPS "
                "is its host's business; use auto or off"))
        if server.mode == "managed" and server.launcher == "command" and not server.command:
            problems.append(KeyProblem(
                "server.command",
                None,
                "server.launcher is 'command' but no command "
                "is set; set server.command: [program, --port, '{port}', ...]",
            ))
        served_name = self.model.served_name
        if (server.mode == "managed" and server.launcher == "genai_server" and served_name
                and served_name != self.model.name):
            problems.append(KeyProblem(
                "model.served_name",
                served_name,
                "paddleocr genai_server serves the model under model.name only; remove "
                "model.served_name, or use server.launcher: vllm",
            ))
        if self.cluster.address is not None and server.mode != "managed":
            problems.append(KeyProblem(
                "server.mode", server.mode,
                "with cluster.address set each node runs its own server (managed); set "
                "server.mode: managed, or remove cluster.address to use this server"))
        names = [p.name for p in self.inbox.paths]
        if self.output.dir is not None and len(set(names)) < len(names):
            problems.append(KeyProblem(
                "inbox.paths",
                [str(p) for p in self.inbox.paths],
                f"with output.dir set, each inbox's results go to output.dir/<its folder "
                f"name>/, and two inboxes are both called {named_twice(names)!r}; rename one",
            ))
        max_len = server.vllm_args["max-model-len"]
        new_tokens = self.model.effective_max_new_tokens
        need = self.model.vl_model.request_token_budget(new_tokens)
        if max_len != AUTO and int(max_len) < need:
            problems.append(KeyProblem(
                "server.vllm_args.max-model-len",
                max_len,
                f"is too small: a page request can need {new_tokens} "
                f"new tokens (model.max_new_tokens) plus {need - new_tokens}"
                f" for the image and prompt, {need} in all, and vLLM would reject it; set "
                f"max-model-len to at least {need}, or lower model.max_new_tokens",
            ))
        if problems:
            raise KeyProblems(problems)
        return self

    @property
    def recipe(self) -> Recipe:
        """How this configuration recognises pages (see `Recipe`)."""
        p = self.pipeline
        steps = (("page orientation", p.use_doc_orientation_classify),
                 ("unwarping", p.use_doc_unwarping), ("charts", p.use_chart_recognition))
        return Recipe(self.model.name, p.use_layout_detection,
                      tuple(name for name, on in steps if on))

    @property
    def config_for_server(self) -> dict[str, Any]:
        """The settings that need a server restart when they change."""
        return {"model": self.model.model_dump(), "server": self.server.model_dump(mode="json")}
