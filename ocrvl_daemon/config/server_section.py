"""The `server` section: the model server, started and looked after by ocrvl or someone else's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from ocrvl_daemon.config.errors import KeyProblem
from ocrvl_daemon.config.layout import AUTO
from ocrvl_daemon.config.section import Section, named_twice
from ocrvl_daemon.config.values import expand_path, expand_vars, openai_base_url

# vLLM flags ocrvl computes from the GPU unless the user gives a number.
AUTO_VLLM_ARGS = ("gpu-memory-utilization", "max-model-len", "max-num-seqs")
# vLLM flags that other keys decide; setting them in vllm_args would contradict those.
RESERVED_VLLM_ARGS = {
    "host": "server.host", "port": "server.port", "served-model-name": "model.served_name",
    "model": "model.weights", "api-key": "server.api_key",
}




class ServerConfig(Section):
    """The model server: started and looked after by ocrvl (`managed`) or someone else's."""

    mode: Literal["managed", "external"] = "managed"
    launcher: Literal["vllm", "genai_server", "command"] = "vllm"
    url: str | None = None
    # Several endpoints (external only); each also normalised to .../v1.
    urls: list[str] | None = None
    # vLLM servers per GPU and the GPUs they run on (managed only); see `server.replicas`.
    replicas: int | Literal["auto"] = "auto"
    gpus: list[int] | Literal["auto"] = "auto"
    # NVIDIA MPS for the replicas of one GPU (managed only); see `server.mps`.
    mps: Literal["auto", "on", "off"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8118, ge=1, le=65535)
    python: Path | None = None
    command: list[str] | None = None
    startup_timeout: float = Field(900.0, gt=0)
    health_interval: float = Field(5.0, gt=0)
    stall_timeout: float = Field(300.0, gt=0)
    stop_timeout: float = Field(30.0, gt=0)
    restart_backoff_initial: float = Field(2.0, gt=0)
    restart_backoff_max: float = Field(300.0, gt=0)
    api_key: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    vllm_args: dict[str, Any] = Field(default_factory=lambda: {k: AUTO for k in AUTO_VLLM_ARGS})

    @field_validator("python")
    @classmethod
    def _expand_python(cls, value: Path | None) -> Path | None:
        return expand_path(value) if value is not None else None

    @field_validator("api_key")
    @classmethod
    def _expand_key(cls, value: str | None) -> str | None:
        return expand_vars(value) if value else value

    @field_validator("url")
    @classmethod
    def _openai_base(cls, value: str | None) -> str | None:
        return None if value is None else openai_base_url(value)

    @field_validator("urls")
    @classmethod
    def _openai_bases(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("is an empty list; give at least one URL, or use server.url")
        urls = [openai_base_url(url) for url in value]
        if len(set(urls)) < len(urls):
            raise KeyProblem("server.urls", value, f"names {named_twice(urls)} twice; each "
                            "endpoint must be listed once (a second entry would not add a "
                            "server, only send it twice the work)")
        return urls

    # Before pydantic's own checks: a union's error would name its branch ("replicas.int").
    @field_validator("replicas", mode="before")
    @classmethod
    def _at_least_one(cls, value: Any) -> Any:
        if value == AUTO:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("must be 'auto' or a whole number of at least 1")
        return value

    @field_validator("mps", mode="before")
    @classmethod
    def _mps(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as true/false.
        if isinstance(value, bool):
            return "on" if value else "off"
        if value not in (AUTO, "on", "off"):
            raise KeyProblem("server.mps", value, "must be auto (MPS when replicas share a GPU "
                             "and nvidia-cuda-mps-control is installed), on or off")
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_indices(cls, value: Any) -> Any:
        if value == AUTO:
            return value
        if not isinstance(value, list) or not value or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in value):
            raise ValueError("must be 'auto' (every visible GPU) or a list of GPU indices as "
                             "CUDA numbers them, e.g. [0, 1]")
        if len(set(value)) < len(value):
            raise KeyProblem("server.gpus", value, f"names GPU {named_twice(value)} twice; list "
                            "each GPU once and use server.replicas for more servers per GPU")
        return value

    @field_validator("command")
    @classmethod
    def _argv(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError(
                "is an empty list; give the server's argv, e.g. [my-server, --port, '{port}']"
            )
        return value

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _flags(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        # `max_model_len` and `--max-model-len` mean the same flag; keep one spelling.
        merged: dict[str, Any] = {k: AUTO for k in AUTO_VLLM_ARGS}
        for key, arg in value.items():
            merged[str(key).lstrip("-").replace("_", "-")] = arg
        return merged

    @field_validator("vllm_args")
    @classmethod
    def _auto_or_number(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, fix in RESERVED_VLLM_ARGS.items():
            if key in value:
                raise KeyProblem(f"server.vllm_args.{key}", value[key],
                                f"is set by ocrvl itself; remove it and use {fix} instead")
        for key in AUTO_VLLM_ARGS:
            arg = value[key]
            if arg == AUTO:
                continue
            name = f"server.vllm_args.{key}"
            if isinstance(arg, bool) or not isinstance(arg, (int, float)) or arg <= 0:
                raise KeyProblem(name, arg, "must be 'auto' or a positive number")
            if key == "gpu-memory-utilization" and not 0 < arg <= 1:
                raise KeyProblem(
                    name,
                    arg,
                    "is a fraction of the GPU's memory: use 'auto' or a value such as 0.8",
                )
            if key != "gpu-memory-utilization" and int(arg) != arg:
                raise KeyProblem(name, arg, "must be a whole number or 'auto'")
        return value

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (ending in /v1) the pipeline talks to (the first of several)."""
        if self.mode == "external" and (self.url or self.urls):
            return self.url or (self.urls or [""])[0]
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        """The server root, where `/health` and `/metrics` live."""
        return self.base_url.removesuffix("/v1")


