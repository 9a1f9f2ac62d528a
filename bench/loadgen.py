"""A direct load generator: N requests always in flight against the simulated server.

It measures the simulator's own throughput at each concurrency, without any PDF pipeline
in the way (so the client costs almost nothing): this is the server's maximum, and its
curve against concurrency shows the peak. `replay` sends a given list of pages the same
way: the best any client held to N in flight could do with them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from testkit.harness import chat_payload, make_test_jpeg

PAGE_SIZE = (800, 1584)  # what a 400x792 pt page rendered at 2x looks like


@dataclass
class Point:
    concurrency: int
    pages_per_s: float
    tokens_per_s: float
    occupancy: float
    mean_active: float
    preemptions: int


def images(count: int) -> list[bytes]:
    """Distinct page-sized JPEGs (distinct digests, so distinct output lengths)."""
    return [make_test_jpeg(seed, PAGE_SIZE) for seed in range(count)]


def answered(response: httpx.Response) -> None:
    """Raise with the server's own words when it refused a request (vLLM says why in the
    body of a 400; the status alone does not)."""
    if response.is_error:
        raise RuntimeError(f"the server answered {response.status_code} to a page: "
                           f"{response.text[:1000]}")


async def _measure(
    url: str,
    model: str,
    jpegs: list[bytes],
    concurrency: int,
    warmup: float,
    seconds: float,
    max_tokens: int,
) -> Point:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        counter = iter(range(10**9))
        done: list[float] = []
        stop = asyncio.Event()

        async def worker() -> None:
            while not stop.is_set():
                n = next(counter)
                jpeg = jpegs[n % len(jpegs)]
                body = chat_payload(jpeg, model=model, max_completion_tokens=max_tokens)
                answered(await client.post("/v1/chat/completions", json=body))
                done.append(time.monotonic())

        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warmup)
        before = (await client.get("/fake/stats")).json()
        await client.post("/fake/reset")
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        after = (await client.get("/fake/stats")).json()
        t1 = time.monotonic()
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    tokens = after["generation_tokens"] - before["generation_tokens"]
    pages = sum(1 for t in done if t0 <= t < t1)
    return Point(
        concurrency,
        pages / (t1 - t0),
        tokens / (t1 - t0),
        after["occupancy"],
        after["mean_active_busy"],
        after["preemptions"] - before["preemptions"],
    )


def measure(
    url: str,
    model: str,
    concurrency: int,
    warmup: float,
    seconds: float,
    jpegs: list[bytes],
    max_tokens: int = 4096,
) -> Point:
    """Throughput with `concurrency` requests always in flight (after `warmup` seconds).

    `max_tokens` caps each answer: a small cap gives short pages (the calibration's
    150-token point).
    """
    return asyncio.run(_measure(url, model, jpegs, concurrency, warmup, seconds, max_tokens))


async def _replay(url: str, model: str, lengths: list[int], concurrency: int) -> float:
    jpegs = images(min(len(lengths), 200))
    bodies = [chat_payload(jpegs[i % len(jpegs)], model=model, max_completion_tokens=n)
              for i, n in enumerate(lengths)]  # fmt: skip
    return await send_all(url, bodies, concurrency)


async def send_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to send `bodies` in order with `concurrency` always in flight (until the last
    one is sent, then the rest drain): the direct feeder."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        queue = iter(bodies)

        async def worker() -> None:
            for body in queue:  # shared iterator: each body is sent once, in order
                answered(await client.post("/v1/chat/completions", json=body))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.monotonic() - t0


def replay(url: str, model: str, lengths: list[int], concurrency: int) -> float:
    """Seconds to send pages whose answers are `lengths` tokens long, in that order, with
    `concurrency` always in flight and nothing else to do (no PDF work, no gaps).

    The server must answer at least max(lengths) tokens per request (e.g. `fixed:8192`):
    each request's max tokens then sets its length.
    """
    return asyncio.run(_replay(url, model, lengths, concurrency))
