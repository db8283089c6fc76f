"""Load test of the API on loopback: real routes against a plain route serving the same bytes.

Starts two uvicorn servers on 127.0.0.1 in this process's threads: the service
(`create_app`, on the chosen database) and a bare Starlette app whose one
route returns, from memory, the exact payload the service returned for the
same request. Each route gets the same bounded number of requests at the same
concurrency; the run stops by itself. Prints req/s, p50 and p99 per route and
their ratio to the plain route, and writes them as JSON.

    python scripts/load_api.py [--requests 2000] [--concurrency 16] [--backend embedded]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from pymongo import AsyncMongoClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.api import create_app
from app.embedded import ServerThread
from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from app.service import Store
from app.settings import Settings

TOKEN = "load-test-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
# The routes measured: name -> path on the service.
ROUTES = {
    "list": f"/v1/users/{EXAMPLE_USER_ID}/conversations?limit=20",
    "transcript": f"/v1/conversations/{EXAMPLE_CONVERSATION_ID}/transcript",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn on loopback in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def plain_app(payloads: dict[str, bytes]) -> Starlette:
    """One route per measured route, answering with the recorded bytes."""

    def endpoint(body: bytes) -> Callable[[Request], Any]:
        async def serve(request: Request) -> Response:
            return Response(body, media_type="application/json")

        return serve

    return Starlette(routes=[Route(f"/plain/{n}", endpoint(b)) for n, b in payloads.items()])


async def hammer(url: str, *, requests: int, concurrency: int) -> dict[str, float]:
    """Send `requests` GETs with `concurrency` in flight; latency figures in milliseconds."""
    latencies: list[float] = []
    failures = 0
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        for _ in queue:
            started = time.perf_counter()
            response = await client.get(url, headers=HEADERS)
            latencies.append((time.perf_counter() - started) * 1000)
            failures += response.status_code != 200

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        began = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    ordered = sorted(latencies)
    return {
        "requests": requests,
        "failures": failures,
        "req_per_s": requests / elapsed,
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[max(int(len(ordered) * 0.99) - 1, 0)],
    }


async def seed(store: Store, conversations: int) -> None:
    await store.logger.ensure_indexes()
    for turn_id, messages in example_turns():
        await store.logger.log_messages(
            EXAMPLE_CONVERSATION_ID, messages, user_id=EXAMPLE_USER_ID, turn_id=turn_id
        )
    for n in range(conversations - 1):
        await store.logger.log_messages(
            f"load-{n:04d}", [{"role": "user", "content": f"hello {n}"}], user_id=EXAMPLE_USER_ID
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    embedded = None
    if args.backend == "uri":
        uri = os.environ.get("MONGODB_URI") or ""
        if not uri:
            raise SystemExit("--backend uri needs MONGODB_URI")
    else:
        embedded = ServerThread()
        uri = embedded.start()
    database = f"load_{int(time.time())}"
    # The service owns its client on its own loop; seeding uses a client on this loop.
    settings = Settings(mongodb_uri=uri, database=database, service_tokens=[TOKEN])

    async def seed_database() -> None:
        client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
        await seed(Store.on(client[database], settings), args.conversations)
        await client.close()

    loop.run_until_complete(seed_database())
    results: dict[str, Any] = {"backend": args.backend, "routes": {}}
    try:
        with serving(create_app(settings)) as service:
            payloads = {
                name: httpx.get(service + path, headers=HEADERS).content
                for name, path in ROUTES.items()
            }
            for name, body in payloads.items():
                if not body.startswith(b"{") or b'"error"' in body[:20]:
                    raise SystemExit(f"route {name} did not answer with data: {body[:200]!r}")
            with serving(plain_app(payloads)) as plain:
                for name, path in ROUTES.items():
                    # Interleave: warm both, then measure plain, service, plain, service.
                    rounds: dict[str, list[dict[str, float]]] = {"service": [], "plain": []}
                    for url in (f"{plain}/plain/{name}", service + path):
                        loop.run_until_complete(hammer(url, requests=50, concurrency=4))
                    for _ in range(2):
                        for target, url in (
                            ("plain", f"{plain}/plain/{name}"),
                            ("service", service + path),
                        ):
                            rounds[target].append(
                                loop.run_until_complete(
                                    hammer(
                                        url,
                                        requests=args.requests // 2,
                                        concurrency=args.concurrency,
                                    )
                                )
                            )
                    results["routes"][name] = {
                        "payload_bytes": len(payloads[name]),
                        **{t: _merge(r) for t, r in rounds.items()},
                    }
    finally:
        loop.close()
        if embedded is not None:
            embedded.stop()
    return results


def _merge(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {
        "requests": sum(r["requests"] for r in rounds),
        "failures": sum(r["failures"] for r in rounds),
        "req_per_s": statistics.mean(r["req_per_s"] for r in rounds),
        "p50_ms": statistics.mean(r["p50_ms"] for r in rounds),
        "p99_ms": max(r["p99_ms"] for r in rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per route and target")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=30, help="seeded for the list route")
    parser.add_argument("--backend", choices=["embedded", "uri"], default="embedded")
    parser.add_argument("--output", type=Path, default=Path("bench-results/load_api.json"))
    args = parser.parse_args()
    if not 1 <= args.requests <= 100_000 or not 1 <= args.concurrency <= 256:
        raise SystemExit("--requests must be 1..100000 and --concurrency 1..256")
    results = run(args)
    print(f"API load test on loopback, backend={args.backend}, {args.concurrency} in flight")
    print(
        f"{'route':<12}{'target':<9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'fail':>6}{'bytes':>8}"
    )
    for name, figures in results["routes"].items():
        for target in ("plain", "service"):
            f = figures[target]
            print(
                f"{name:<12}{target:<9}{f['req_per_s']:>9.0f}{f['p50_ms']:>9.2f}"
                f"{f['p99_ms']:>9.2f}{f['failures']:>6}{figures['payload_bytes']:>8}"
            )
        ratio = figures["plain"]["req_per_s"] / figures["service"]["req_per_s"]
        print(f"{'':<12}service serves {1 / ratio:.2f}x the plain route's req/s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
