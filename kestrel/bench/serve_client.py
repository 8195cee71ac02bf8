"""The client side of `kestrel bench serve`: streaming /v1/completions requests sent at their arrival times, timed
chunk by chunk, in this process or spread over several (a Python client parsing ten thousand streamed chunks a
second is itself busy enough to delay its own timestamps).

Times are time.perf_counter() values, which on Linux read the system-wide monotonic clock, so the start times of
requests sent by different processes compare directly."""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import httpx2

from kestrel.bench.serve_data import SampleRequest
from kestrel.bench.serve_metrics import RequestResult

PROCESS_START_S = 2.0  # head start the client processes get before the first arrival (forked: no imports)


def http_client(timeout: float, headers: dict, connections: int) -> httpx2.AsyncClient:
    """One keep-alive connection pool of `connections` (as vLLM's client keeps its connections)."""
    return httpx2.AsyncClient(timeout=httpx2.Timeout(timeout), headers=headers,
                              limits=httpx2.Limits(max_connections=connections, max_keepalive_connections=connections))


async def send_completion(client: httpx2.AsyncClient, url: str, body: dict, req: SampleRequest,
                          disconnect_after: int | None) -> RequestResult:
    """One streaming /v1/completions request, timed from its send to each chunk that carries text."""
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.expected_output_len)
    text: list[str] = []
    chunks = 0
    res.start_time = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json={**body, "prompt": req.prompt,
                                                                        "max_tokens": req.expected_output_len}) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"].get("completion_tokens") or 0
                if not obj.get("choices") or not obj["choices"][0].get("text"):
                    continue
                if chunks == 0:
                    res.ttft = now - res.start_time
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
                text.append(obj["choices"][0]["text"])
                if disconnect_after is not None and chunks >= disconnect_after:
                    res.disconnected = True
                    return res  # leaving the context manager closes the connection mid-stream
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.generated_text = "".join(text)
    if chunks == 0:
        res.error = "the stream ended without any text"
        return res
    res.latency = last - res.start_time
    res.success = True
    return res


async def run_requests(client: httpx2.AsyncClient, url: str, body: dict, requests: list[SampleRequest],
                       arrivals: list[float], max_concurrency: int | None, disconnects: list[int | None],
                       t0: float | None = None) -> list[RequestResult]:
    """Sends each request at t0 + its arrival time (t0: now by default), waiting for a slot under
    max_concurrency; their results once all are done."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(req, disc):
        async with slots:
            return await send_completion(client, url, body, req, disc)

    t0 = time.perf_counter() if t0 is None else t0
    tasks = []
    for req, at, disc in zip(requests, arrivals, disconnects):
        wait = t0 + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req, disc)))
    return list(await asyncio.gather(*tasks))


async def _load(url, headers, body, requests, arrivals, max_concurrency, disconnects, timeout,
                t0: float) -> tuple[list[RequestResult], float, float]:
    """(results, end time, CPU seconds) of one process's share, its first arrival at t0 + arrivals[0]."""
    async with http_client(timeout, headers, max_concurrency or len(requests)) as client:
        cpu0 = time.process_time()
        results = await run_requests(client, url, body, requests, arrivals, max_concurrency, disconnects, t0)
        return results, time.perf_counter(), time.process_time() - cpu0


def _load_in_process(*args) -> tuple[list[RequestResult], float, float]:
    return asyncio.run(_load(*args))


def split_concurrency(max_concurrency: int | None, parts: int) -> list[int | None]:
    """The global limit as per-process limits that add up to it (None: no limit)."""
    if max_concurrency is None:
        return [None] * parts
    return [max_concurrency // parts + (i < max_concurrency % parts) for i in range(parts)]


async def run_load(url: str, headers: dict, body: dict, requests: list[SampleRequest], arrivals: list[float],
                   max_concurrency: int | None, disconnects: list[int | None], timeout: float,
                   processes: int) -> tuple[list[RequestResult], float, float]:
    """Sends every request at its arrival time; (results in request order, seconds from the first possible
    arrival to the last end, CPU seconds of the busiest client process). processes > 1: request i goes out from
    process i % processes, each a forked copy of this one with its own event loop and connections."""
    n = max(1, min(processes, len(requests), max_concurrency or len(requests)))
    if n == 1:
        t0 = time.perf_counter()
        results, end, cpu = await _load(url, headers, body, requests, arrivals, max_concurrency, disconnects,
                                        timeout, t0)
        return results, end - t0, cpu
    t0 = time.perf_counter() + PROCESS_START_S
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork")) as pool:
        shares = await asyncio.gather(*(loop.run_in_executor(
            pool, _load_in_process, url, headers, body, requests[i::n], arrivals[i::n], limit, disconnects[i::n],
            timeout, t0) for i, limit in enumerate(split_concurrency(max_concurrency, n))))
    results: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for i, (part, _, _) in enumerate(shares):
        results[i::n] = part
    return results, max(end for _, end, _ in shares) - t0, max(cpu for _, _, cpu in shares)
