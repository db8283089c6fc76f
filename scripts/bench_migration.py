"""Benchmark the migration: the pure converter's turns per second of CPU, then turns per
second and peak RSS of `python -m migrations run`.

The converter figure is CPU time in this process (one core) to parse and convert a mixed
corpus: the messy corpus of the exit-gate tests (every kind of mess, a 5.3 MB tool result)
and generated conversations; best of five rounds. The target is at least 3,500 turns/s.

The database lives outside the measured process: MONGODB_URI if set, else a
mongoeco wire server started here (in this process, not in the migration's).
For each corpus size the legacy turns are seeded into
`agent_conversations_deprecated` of a fresh database, then the migration runs
as a child process; its peak RSS comes from the kernel (`wait4`).

mongoeco scans a collection on every insert, so on it throughput falls as the
collection grows and sizes must stay small (the defaults take a few minutes), and
batches small: the server runs in this process's event loop and a long insert
would stall the driver's heartbeats. Against a real MongoDB pass larger sizes
with --sizes and a larger --batch-size.

    python scripts/bench_migration.py [--sizes 14,150] [--turns 3] [--batch-size 10]
    python scripts/bench_migration.py --converter-only
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pymongo import MongoClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent_store.legacy import (  # noqa: E402
    LEGACY_TURNS,
    convert,
    group_conversations,
    parse_turns,
)
from scripts.legacy_corpus import legacy_corpus, messy_corpus  # noqa: E402

CONVERTER_TARGET = 3_500
"""Turns per second of CPU, per core, the converter must keep."""

# The migration's own peak RSS: VmHWM of its address space, which starts at exec. (A
# child's ru_maxrss would also count the pages it shared with this process before exec.)
PEAK_RSS_WRAPPER = """
import atexit, re, runpy, sys
def report():
    status = open("/proc/self/status").read()
    print(re.search(r"VmHWM:.*", status).group(0), file=sys.stderr)
atexit.register(report)
sys.argv = ["migrations", *sys.argv[1:]]
runpy.run_module("migrations", run_name="__main__")
"""


@contextmanager
def database_server() -> Iterator[str]:
    """MONGODB_URI, or a mongoeco wire server on a free port for as long as the block lasts."""
    if os.environ.get("MONGODB_URI"):
        yield os.environ["MONGODB_URI"]
        return
    from mongoeco.engines.memory import MemoryEngine
    from mongoeco.wire.proxy import AsyncMongoEcoProxyServer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = AsyncMongoEcoProxyServer(
        engine=MemoryEngine(),
        host="127.0.0.1",
        port=0,
        mongodb_dialect="7.0",
        pymongo_profile="auto-installed",
    )
    address = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield f"mongodb://{address.host}:{address.port}/?directConnection=true"
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def converter_throughput(rounds: int = 5) -> dict[str, Any]:
    """Turns per second of CPU time to parse and convert a mixed corpus (best of `rounds`)."""
    corpus = messy_corpus() + list(legacy_corpus(150, turns=3, text_chars=1000))
    best = float("inf")
    turns = messages = 0
    for _ in range(rounds):
        started = time.process_time()
        conversions = [
            convert(group) for group in group_conversations(parse_turns(corpus)).values()
        ]
        best = min(best, time.process_time() - started)
        turns = sum(c.turns for c in conversions)
        messages = sum(len(c.messages) for c in conversions)
    return {
        "conversations": len(conversions),
        "turns": turns,
        "messages": messages,
        "cpu_seconds": best,
        "turns_per_s": turns / best,
    }


def measure(uri: str, conversations: int, turns: int, batch_size: int) -> dict[str, Any]:
    client: MongoClient[dict[str, Any]] = MongoClient(uri)
    name = f"bench_migration_{uuid.uuid4().hex[:8]}"
    try:
        corpus = list(legacy_corpus(conversations, turns=turns, text_chars=1000))
        for start in range(0, len(corpus), 500):
            client[name][LEGACY_TURNS].insert_many(corpus[start : start + 500])
        del corpus
        command = [sys.executable, "-c", PEAK_RSS_WRAPPER, "run", "--uri", uri]
        command += ["--database", name, "--batch-size", str(batch_size), "--progress", "none"]
        started = time.monotonic()
        finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        elapsed = time.monotonic() - started
        output = finished.stdout
        if finished.returncode != 0:
            raise SystemExit(f"the migration failed:\n{output}{finished.stderr}")
        summary = re.search(r"(\d+) turns -> (\d+) messages", output)
        rate = re.search(r"([\d.]+) turns/s", output)
        peak = re.search(r"VmHWM:\s+(\d+) kB", finished.stderr)
        if summary is None or rate is None or peak is None:
            raise SystemExit(f"unexpected output of the migration:\n{output}")
        return {
            "conversations": conversations,
            "turns": int(summary[1]),
            "messages": int(summary[2]),
            "seconds": elapsed,
            "turns_per_s": float(rate[1]),
            "peak_rss_mb": int(peak[1]) / 1024,
        }
    finally:
        client.drop_database(name)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="14,150", help="conversation counts, comma-separated")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (about)")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--converter-only", action="store_true", help="skip the database runs")
    args = parser.parse_args()
    c = converter_throughput()
    verdict = "met" if c["turns_per_s"] >= CONVERTER_TARGET else "MISSED"
    print(
        f"converter: {c['conversations']} conversations, {c['turns']} turns -> "
        f"{c['messages']} messages in {c['cpu_seconds']:.3f} s of CPU: "
        f"{c['turns_per_s']:,.0f} turns/s per core (target {CONVERTER_TARGET:,}: {verdict})",
        flush=True,
    )
    if args.converter_only:
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with database_server() as uri:
        where = "MONGODB_URI" if os.environ.get("MONGODB_URI") else "mongoeco (memory engine)"
        print(f"database: {where}; batch size {args.batch_size}; ~{args.turns} turns/conversation")
        print(f"{'conversations':>13} {'turns':>7} {'messages':>9} {'wall s':>8} "
              f"{'turns/s':>8} {'peak RSS MB':>12}")  # fmt: skip
        results = []
        for size in sizes:
            r = measure(uri, size, args.turns, args.batch_size)
            results.append(r)
            print(
                f"{r['conversations']:>13} {r['turns']:>7} {r['messages']:>9} "
                f"{r['seconds']:>8.1f} {r['turns_per_s']:>8.1f} {r['peak_rss_mb']:>12.1f}",
                flush=True,
            )
        first, last = results[0], results[-1]
        print(
            f"corpus x{last['turns'] / first['turns']:.1f}: "
            f"peak RSS x{last['peak_rss_mb'] / first['peak_rss_mb']:.2f}"
        )


if __name__ == "__main__":
    main()
