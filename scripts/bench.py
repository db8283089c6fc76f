"""Benchmark: this store against its peers, on a database reached across a (simulated) network.

Run `make bench` (or `python -m scripts.bench --help`). Every contender talks to
the same database through `scripts.latency_proxy`, which holds each reply for a
configurable round-trip latency (0.2, 1 and 5 ms by default), so a round trip
costs what it costs on a network. Sections:

writes   the same turns stored by every writer of `scripts.bench_contenders` (this store's
         logger, the raw driver sending the logger's two commands, one raw `insert_many`,
         langchain-mongodb, LangGraph with the MongoDB checkpointer, a LibreChat-style
         writer), per latency; contenders interleaved and rotated, one warm-up.
growth   one conversation of up to 500 turns, logger and LangGraph: cost per turn by turn number.
sizes    turns of 1 to 64 messages, logger and raw two commands: our cost per turn and message.
reads    a 1,000-message transcript: `transcript` against a raw `find` returning dicts (and
         langchain's `messages`, and the legacy turns), on the wire server and on mongomock.
loops    the logger and a transcript under asyncio's event loop and under uvloop.

Figures per contender: wall time (median and per-repetition range); "network wall", the
wall time less the time the stand-in server took to answer (measured at the proxy), i.e.
what a client facing a fast server across that network waits; client CPU
(`time.process_time()` of this process) split into the driver's (inside PyMongo,
`scripts.driver_clock`) and ours (everything else: for a peer, its library); round trips
(commands through the proxy). The database runs in another process; the proxy too.

On MONGODB_URI (`--backend uri`) it creates and drops databases named `bench_*`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.bench_contenders import WRITERS, Workload, prepare_workload, write_contender
from scripts.bench_measure import Deployment, Series, connect, paired_ratio, rotated
from scripts.bench_reads import bench_reads, bench_reads_mongomock
from scripts.bench_report import print_section, verdicts
from scripts.corpus import Corpus

DEFAULT_OUT = Path("bench-results/bench.json")
SECTIONS = ("writes", "growth", "sizes", "reads", "loops")


async def bench_writes(deployment: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    corpus = Corpus(seed=11)
    workload = await prepare_workload(
        [corpus.conversation(args.turns) for _ in range(args.conversations)]
    )
    writers = args.writers.split(",")
    by_latency: dict[str, Any] = {}
    async with connect(deployment) as clients:
        for latency in args.latencies:
            deployment.proxy.latency_ms = latency
            series = await _interleaved(clients, workload, writers, args.repetitions, "w")
            by_latency[f"{latency:g}"] = {
                "contenders": [s.summary() for s in series.values()],
                "ratios": _write_ratios(series),
            }
    return {
        "conversations": args.conversations,
        "turns": workload.turns,
        "messages": workload.messages,
        "repetitions": args.repetitions,
        "by_latency_ms": by_latency,
    }


async def _interleaved(
    clients: Any, workload: Workload, writers: list[str], repetitions: int, tag: str
) -> dict[str, Series]:
    """Every writer stores the whole workload once per repetition, in rotating order."""
    series = {n: Series(n, workload.turns, workload.messages) for n in writers}
    for repetition in range(-1, repetitions):  # -1: warm-up, not recorded
        for name in rotated(writers, repetition):
            db_name = f"bench_{tag}_{name.replace(' ', '_')}_{repetition + 1}"
            async with write_contender(
                name, clients.async_client, clients.sync_client, workload, db_name
            ) as step:

                async def run(step: Callable[[int, int], Any] = step) -> None:
                    for c, conversation in enumerate(workload.conversations):
                        for t in range(len(conversation.turns)):
                            await step(c, t)

                sample = await clients.meter.measure(run)
            if repetition >= 0:
                series[name].samples.append(sample)
    return series


def _write_ratios(series: dict[str, Series]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    logger = series.get("logger")
    if logger is None:
        return ratios
    for other in series:
        if other == "logger":
            continue
        ratios[f"logger / {other}"] = {
            metric: paired_ratio(logger, series[other], metric)
            for metric in ("network_wall", "wall", "cpu", "ours")
        }
    if "raw two" in series and "langchain" in series:
        # The floor under the logger's target against langchain: its two commands alone.
        ratios["raw two / langchain"] = {
            "network_wall": paired_ratio(series["raw two"], series["langchain"], "network_wall")
        }
    return ratios


async def _per_turn(clients: Any, workload: Workload, name: str, tag: str) -> list[Any]:
    """One sample per turn of the workload's single conversation."""
    samples = []
    async with write_contender(
        name, clients.async_client, clients.sync_client, workload, f"bench_{tag}"
    ) as step:
        for t in range(len(workload.conversations[0].turns)):
            samples.append(await clients.meter.measure(lambda t=t: step(0, t)))
    return samples


def _window(samples: list[Any], turn: int, metric: str, half: int = 5) -> float | None:
    """The median of `metric` over the turns around `turn` (1-based), in µs or ms."""
    chosen = samples[max(turn - half, 0) : turn + half]
    if turn > len(samples) or not chosen:
        return None
    scale = 1e3 if "wall" in metric else 1e6
    return statistics.median(s.metric(metric) for s in chosen) * scale


async def _logger_growth(clients: Any, conversation: Any, turns: int) -> list[tuple[Any, Any]]:
    """Per turn of one long conversation, that turn and a control: the same messages logged
    right after as the first turn of a new conversation, in the same database. Both meet the
    same server and the same waits (the stand-in slows down as its collection grows, and a
    long wait leaves this process's caches cold); only the conversation's length differs."""
    from agent_store import AgentMessageLogger

    db = clients.async_client["bench_growth_logger"]
    logger = AgentMessageLogger(db)
    await logger.ensure_indexes()
    long_turns = copy.deepcopy(conversation.turns[:turns])
    control_turns = copy.deepcopy(conversation.turns[:turns])
    cid, user = conversation.conversation_id, conversation.user_id
    pairs = []
    try:
        for t in range(turns):
            turn_id, messages = long_turns[t]
            _, same = control_turns[t]
            log = functools.partial(logger.log_messages, user_id=user, turn_id=turn_id)
            long_sample = await clients.meter.measure(functools.partial(log, cid, messages))
            control = await clients.meter.measure(functools.partial(log, f"control-{t}", same))
            pairs.append((long_sample, control))
    finally:
        await clients.async_client.drop_database("bench_growth_logger")
    return pairs


def _at_turns(samples: list[Any], turns: int) -> dict[str, Any]:
    points = [p for p in (1, 10, 50, 100, 250, 500) if p <= turns]
    metrics = ("ours", "driver", "network_wall", "wall", "commands")
    return {str(p): {m: _window(samples, p, m) for m in metrics} for p in points}


async def bench_growth(deployment: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    corpus = Corpus(seed=23)
    conversation = corpus.conversation(max(args.growth_turns, args.langgraph_growth_turns))
    deployment.proxy.latency_ms = args.growth_latency
    out: dict[str, Any] = {"latency_ms": args.growth_latency, "contenders": {}}
    async with connect(deployment) as clients:
        if args.growth_turns > 0:
            pairs = await _logger_growth(clients, conversation, args.growth_turns)
            at = _at_turns([long for long, _ in pairs], args.growth_turns)
            controls = _at_turns([control for _, control in pairs], args.growth_turns)
            ratios = [long.ours / control.ours for long, control in pairs]
            for turn, values in at.items():
                values["control_ours"] = controls[turn]["ours"]
                window = ratios[max(int(turn) - 5, 0) : int(turn) + 5]
                values["ours_vs_control"] = statistics.median(window)
            out["contenders"]["logger"] = {"turns": args.growth_turns, "at_turn": at}
        if args.langgraph_growth_turns > 0:
            full = await prepare_workload([conversation])
            workload = _first_turns(full, args.langgraph_growth_turns)
            samples = await _per_turn(clients, workload, "langgraph", "growth_langgraph")
            out["contenders"]["langgraph"] = {
                "turns": args.langgraph_growth_turns,
                "at_turn": _at_turns(samples, args.langgraph_growth_turns),
            }
    logger = out["contenders"].get("logger", {}).get("at_turn", {})
    last = logger.get(str(args.growth_turns))
    if last and "10" in logger:
        out["logger_ours_last_vs_turn_10"] = last["ours"] / logger["10"]["ours"]
        out["logger_controlled_last_vs_turn_10"] = (
            last["ours_vs_control"] / logger["10"]["ours_vs_control"]
        )
    return out


def _first_turns(workload: Workload, turns: int) -> Workload:
    (conversation,) = workload.conversations
    cid = conversation.conversation_id
    return Workload(
        [type(conversation)(cid, conversation.user_id, conversation.turns[:turns])],
        {cid: workload.stored[cid][:turns]},
        {cid: workload.reservations[cid][:turns]},
        {cid: workload.langchain[cid][:turns]},
        {cid: workload.librechat[cid][:turns]},
    )


async def bench_sizes(deployment: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    deployment.proxy.latency_ms = args.latencies[0]
    rows = []
    async with connect(deployment) as clients:
        for size in args.sizes:
            corpus = Corpus(seed=31 + size)
            workload = await prepare_workload(
                [corpus.conversation_of_turn_size(args.size_turns, size)]
            )
            series = await _interleaved(
                clients, workload, ["logger", "raw two"], args.size_repetitions, f"s{size}"
            )
            net = [
                (mine.ours - raw.ours) / workload.turns * 1e6
                for mine, raw in zip(
                    series["logger"].samples, series["raw two"].samples, strict=True
                )
            ]
            rows.append(
                {
                    "messages_per_turn": size,
                    "logger_ours_net_us": statistics.median(net),
                    **{n: s.summary() for n, s in series.items()},
                }
            )
    sizes = [r["messages_per_turn"] for r in rows]
    ours = [r["logger_ours_net_us"] for r in rows]
    per_turn, per_message = _least_squares(sizes, ours)
    return {
        "latency_ms": args.latencies[0],
        "turns_per_size": args.size_turns,
        "rows": rows,
        "logger_ours_fit_us": {"per_turn": per_turn, "per_message": per_message},
    }


def _least_squares(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of the straight line through (xs, ys) that fits best."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    return mean_y - slope * mean_x, slope


def bench_loops(deployment: Deployment, args: argparse.Namespace) -> dict[str, Any]:
    """The logger's and the transcript's client CPU under asyncio and under uvloop."""
    import uvloop

    factories = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    deployment.proxy.latency_ms = args.latencies[0]
    corpus = Corpus(seed=41)
    conversations = [corpus.conversation(args.loop_turns) for _ in range(args.loop_conversations)]
    cpu: dict[str, list[float]] = {name: [] for name in factories}
    reads: dict[str, list[float]] = {name: [] for name in factories}
    for repetition in range(-1, args.loop_repetitions):
        for name in rotated(list(factories), repetition):
            write_cpu, read_cpu = asyncio.run(
                _loop_round(deployment, conversations), loop_factory=factories[name]
            )
            if repetition >= 0:
                cpu[name].append(write_cpu)
                reads[name].append(read_cpu)
    ratio = [u / a for u, a in zip(cpu["uvloop"], cpu["asyncio"], strict=True)]
    read_ratio = [u / a for u, a in zip(reads["uvloop"], reads["asyncio"], strict=True)]
    return {
        "logger_cpu_us_per_message": {n: statistics.median(v) for n, v in cpu.items()},
        "transcript_cpu_us_per_message": {n: statistics.median(v) for n, v in reads.items()},
        "uvloop_vs_asyncio_logger": {
            "median": statistics.median(ratio),
            "min": min(ratio),
            "max": max(ratio),
        },
        "uvloop_vs_asyncio_transcript": {
            "median": statistics.median(read_ratio),
            "min": min(read_ratio),
            "max": max(read_ratio),
        },
    }


async def _loop_round(deployment: Deployment, conversations: list[Any]) -> tuple[float, float]:
    from agent_store import AgentMessageLogger, ConversationStore

    async with connect(deployment) as clients:
        db = clients.async_client["bench_loop"]
        logger = AgentMessageLogger(db)
        await logger.ensure_indexes()
        messages = sum(c.message_count for c in conversations)
        inputs = copy.deepcopy(conversations)

        async def write() -> None:
            for c in inputs:
                for turn_id, turn in c.turns:
                    await logger.log_messages(
                        c.conversation_id, turn, user_id=c.user_id, turn_id=turn_id
                    )

        written = await clients.meter.measure(write)
        store = ConversationStore(db)

        async def read() -> None:
            for c in conversations:
                await store.transcript(c.conversation_id)

        read_sample = await clients.meter.measure(read)
        await clients.async_client.drop_database("bench_loop")
    return written.cpu / messages * 1e6, read_sample.cpu / messages * 1e6


def machine() -> dict[str, Any]:
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    import pymongo

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": model,
        "cpus": os.cpu_count(),
        "pymongo": pymongo.version,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    add = parser.add_argument
    add("--backend", default="wire", choices=["wire", "uri"], help="wire: the embedded server")
    add("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    add("--latencies", type=floats, default=[0.2, 1.0, 5.0], help="round-trip ms added")
    add("--writers", default=",".join(WRITERS))
    add("--conversations", type=int, default=2, help="conversations per write repetition")
    add("--turns", type=int, default=4, help="turns per conversation")
    add("--repetitions", type=int, default=7, help="write repetitions (after a warm-up)")
    add("--growth-turns", type=int, default=500, help="turns of the logger's long conversation")
    add("--langgraph-growth-turns", type=int, default=250)
    add("--growth-latency", type=float, default=1.0)
    add("--sizes", type=ints, default=[1, 2, 4, 8, 16, 32, 64], help="messages per turn")
    add("--size-turns", type=int, default=6)
    add("--size-repetitions", type=int, default=5)
    add("--transcript-messages", type=int, default=1000)
    add("--read-repetitions", type=int, default=15)
    add("--loop-repetitions", type=int, default=7)
    add("--loop-conversations", type=int, default=6)
    add("--loop-turns", type=int, default=5)
    add("--loop", default="asyncio", choices=["asyncio", "uvloop"], help="event loop of the run")
    add("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = args.sections.split(",")
    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "backend": args.backend,
        "loop": args.loop,
        "load_average_before": os.getloadavg(),
        "method": __doc__,
    }
    loop_factory = asyncio.new_event_loop
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    started = time.perf_counter()
    deployment = Deployment(args.backend)
    try:
        for name, run in (
            ("writes", bench_writes),
            ("growth", bench_growth),
            ("sizes", bench_sizes),
            ("reads", bench_reads),
        ):
            if name in sections:
                report[name] = asyncio.run(run(deployment, args), loop_factory=loop_factory)
                print_section(name, report[name])
        if "reads" in sections:
            report["reads_mongomock"] = asyncio.run(
                bench_reads_mongomock(args), loop_factory=loop_factory
            )
            print_section("reads_mongomock", report["reads_mongomock"])
        if "loops" in sections:
            report["loops"] = bench_loops(deployment, args)
            print_section("loops", report["loops"])
    finally:
        deployment.close()
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["load_average_after"] = os.getloadavg()
    report["verdicts"] = verdicts(report)
    print_section("verdicts", report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwritten: {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
