"""Load test of the API on loopback: real routes against a plain route serving the same bytes.

Three processes besides this one, all on 127.0.0.1: the database (the embedded
wire server, or MONGODB_URI), the service (`python -m app` under uvicorn), and
a bare Starlette app whose routes return, from memory, the exact payloads the
service returned for the same requests. This process only sends requests: each
route gets the same bounded number of requests at the same concurrency,
interleaved plain/service, and the run stops by itself. Prints req/s, p50 and
p99 per route and the service's share of the plain route's rate; writes JSON.

    python -m scripts.load_api [--requests 2000] [--concurrency 16] [--backend embedded|uri]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from pymongo import AsyncMongoClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.examples import EXAMPLE_CONVERSATION_ID, EXAMPLE_USER_ID, example_turns
from app.service import Store
from app.settings import Settings
from scripts.wire_server import start_wire_server

TOKEN = "load-test-token-0123456789abcdefghij"
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
def child(command: list[str], env: dict[str, str], port: int) -> Iterator[str]:
    """Run a server process until the block ends; yields its base URL once it answers."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/health", timeout=1)
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{command} did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def plain_app() -> Starlette:
    """The baseline: each route answers with the bytes recorded in LOAD_PAYLOADS."""
    payloads: dict[str, str] = json.loads(Path(os.environ["LOAD_PAYLOADS"]).read_text())

    def endpoint(body: bytes) -> Any:
        async def serve(request: Request) -> Response:
            return Response(body, media_type="application/json")

        return serve

    routes = [Route(f"/plain/{name}", endpoint(body.encode())) for name, body in payloads.items()]
    return Starlette(routes=[*routes, Route("/health", endpoint(b"{}"))])


async def hammer(url: str, *, requests: int, concurrency: int) -> dict[str, float]:
    """Send `requests` GETs with `concurrency` in flight; latencies in milliseconds."""
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
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
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


async def seed(uri: str, database: str, conversations: int) -> None:
    """The example conversation and `conversations - 1` short ones for the same user."""
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, tz_aware=True)
    store = Store.on(client[database], Settings())
    await store.logger.ensure_indexes()
    for turn_id, messages in example_turns():
        await store.logger.log_messages(
            EXAMPLE_CONVERSATION_ID, messages, user_id=EXAMPLE_USER_ID, turn_id=turn_id
        )
    for n in range(conversations - 1):
        await store.logger.log_messages(
            f"load-{n:04d}", [{"role": "user", "content": f"hello {n}"}], user_id=EXAMPLE_USER_ID
        )
    await client.close()


def _merge(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {
        "requests": sum(r["requests"] for r in rounds),
        "failures": sum(r["failures"] for r in rounds),
        "req_per_s": statistics.mean(r["req_per_s"] for r in rounds),
        "p50_ms": statistics.mean(r["p50_ms"] for r in rounds),
        "p99_ms": max(r["p99_ms"] for r in rounds),
    }


def measure(args: argparse.Namespace, uri: str, workdir: Path) -> dict[str, Any]:
    database = f"load_{int(time.time())}"
    asyncio.run(seed(uri, database, args.conversations))
    service_port, plain_port = free_port(), free_port()
    env = os.environ | {
        "MONGODB_URI": uri,
        "AGENT_STORE_DATABASE": database,
        "AGENT_STORE_SERVICE_TOKENS": json.dumps([TOKEN]),
        "AGENT_STORE_PORT": str(service_port),
    }
    results: dict[str, Any] = {"backend": args.backend, "routes": {}}
    with child([sys.executable, "-m", "app"], env, service_port) as service:
        payloads = {
            name: httpx.get(service + path, headers=HEADERS).text for name, path in ROUTES.items()
        }
        for name, body in payloads.items():
            if not body.startswith("{") or body.startswith('{"error"'):
                raise SystemExit(f"route {name} did not answer with data: {body[:200]!r}")
        payload_file = workdir / "payloads.json"
        payload_file.write_text(json.dumps(payloads))
        plain_command = [
            sys.executable, "-m", "uvicorn", "--factory", "scripts.load_api:plain_app",
            "--host", "127.0.0.1", "--port", str(plain_port), "--log-level", "warning",
        ]  # fmt: skip
        with child(plain_command, env | {"LOAD_PAYLOADS": str(payload_file)}, plain_port) as plain:
            for name, path in ROUTES.items():
                targets = {"plain": f"{plain}/plain/{name}", "service": service + path}
                for url in targets.values():  # warm both
                    asyncio.run(hammer(url, requests=50, concurrency=4))
                rounds: dict[str, list[dict[str, float]]] = {"plain": [], "service": []}
                for _ in range(2):
                    for target, url in targets.items():
                        figures = hammer(
                            url, requests=args.requests // 2, concurrency=args.concurrency
                        )
                        rounds[target].append(asyncio.run(figures))
                results["routes"][name] = {
                    "payload_bytes": len(payloads[name].encode()),
                    **{target: _merge(r) for target, r in rounds.items()},
                }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="per route and target")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=30, help="seeded for the list route")
    parser.add_argument("--backend", choices=["embedded", "uri"], default="embedded")
    parser.add_argument("--output", type=Path, default=Path("bench-results/load_api.json"))
    args = parser.parse_args()
    if not 2 <= args.requests <= 100_000 or not 1 <= args.concurrency <= 256:
        raise SystemExit("--requests must be 2..100000 and --concurrency 1..256")
    server = None
    if args.backend == "uri":
        uri = os.environ.get("MONGODB_URI", "")
        if not uri:
            raise SystemExit("--backend uri needs MONGODB_URI")
    else:
        server, uri = start_wire_server()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            results = measure(args, uri, Path(workdir))
    finally:
        if server is not None:
            assert server.stdin is not None
            server.stdin.close()
            server.wait(30)
    print(f"API load test on loopback, backend={args.backend}, {args.concurrency} in flight,")
    print(f"{args.requests} requests per route and target; servers in their own processes")
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
        share = figures["service"]["req_per_s"] / figures["plain"]["req_per_s"]
        print(f"{'':<12}the service serves {share:.2f}x the plain route's req/s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
