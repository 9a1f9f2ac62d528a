"""Where PaddleX keeps the layout model (PP-DocLayoutV2/V3) and where it would download it from.

The same rules as paddlex 3.7's `official_models` (tests/test_layout_model.py checks them
against the installed paddlex, whose import takes seconds): a model is cached in
`$PADDLE_PDX_CACHE_HOME/official_models/<name>` (default `~/.paddlex`), and a folder there
counts as the model. Otherwise it is downloaded from the model hosts that answer a HEAD
request within a second, `$PADDLE_PDX_MODEL_SOURCE`'s first (Hugging Face by default).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import httpx

CACHE_HOME_ENV = "PADDLE_PDX_CACHE_HOME"
MODEL_SOURCE_ENV = "PADDLE_PDX_MODEL_SOURCE"
HUGGING_FACE_ENDPOINT_ENV = "PADDLE_PDX_HUGGING_FACE_ENDPOINT"
DEFAULT_CACHE_HOME = Path("~/.paddlex")
DEFAULT_SOURCE = "huggingface"
# PaddleX's model hosts in the order it tries them, each with the URL its health check asks.
MODEL_HOSTS: dict[str, str] = {
    "huggingface": "https://huggingface.co",
    "aistudio": "https://aistudio.baidu.com",
    "modelscope": "https://modelscope.cn",
    "bos": "https://paddle-model-ecology.bj.bcebos.com",
}
# PaddleX's own health-check timeout: a host slower than this is skipped by PaddleX too.
HOST_TIMEOUT = 1.0


def model_dir(name: str, env: Mapping[str, str] | None = None) -> Path:
    """The folder PaddleX loads the official model `name` from (and downloads it into)."""
    env = os.environ if env is None else env
    home = env.get(CACHE_HOME_ENV) or str(DEFAULT_CACHE_HOME)
    return Path(home).expanduser().absolute() / "official_models" / name


def hugging_face_repo(name: str) -> str:
    """The Hugging Face repository PaddleX downloads the official model `name` from."""
    return f"PaddlePaddle/{name}"


def download_hosts(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(source, health-check URL) in the order PaddleX tries them."""
    env = os.environ if env is None else env
    hosts = dict(MODEL_HOSTS)
    hosts["huggingface"] = env.get(HUGGING_FACE_ENDPOINT_ENV) or hosts["huggingface"]
    preferred = (env.get(MODEL_SOURCE_ENV) or DEFAULT_SOURCE).lower()
    return sorted(hosts.items(), key=lambda item: item[0] != preferred)


def answering_host(hosts: list[tuple[str, str]], timeout: float = HOST_TIMEOUT
                   ) -> tuple[str, str] | None:
    """The first host that answers PaddleX's health check (HEAD, status below 400), if any."""
    for source, url in hosts:
        try:
            if httpx.head(url, timeout=timeout).status_code < 400:
                return source, url
        except (httpx.HTTPError, httpx.InvalidURL):  # a mistyped endpoint answers nothing
            continue
    return None
