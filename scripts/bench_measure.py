"""How `make bench` measures: the deployment it talks to, one timed run, and the figures kept.

A `Deployment` is a database (the embedded wire server in a process of its own,
or MONGODB_URI) behind a `LatencyProxy`; clients connect through the proxy. A
`Meter` times one run: wall time, the client's CPU (`time.process_time()`),
the part of it spent inside PyMongo (`DriverClock`), and from the proxy the
round trips and the time the server itself took. "ours" is the client CPU
outside the driver.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pymongo import AsyncMongoClient, MongoClient

from scripts.driver_clock import DriverClock
from scripts.latency_proxy import LatencyProxy, ProxyStats
from scripts.wire_server import start_wire_server


@dataclass(frozen=True)
class Sample:
    """One timed run."""

    wall: float
    cpu: float
    """Client CPU: this process, every thread."""
    driver: float
    """The part of `cpu` spent inside PyMongo."""
    commands: int | None
    """Round trips, from the proxy (None without one)."""
    server: float
    """Time the server took to answer, from the proxy (0 without one)."""

    @property
    def ours(self) -> float:
        """Client CPU outside the driver: the contender's own code."""
        return self.cpu - self.driver

    @property
    def network_wall(self) -> float:
        """Wall time less the stand-in server's own time: a fast server across the network."""
        return self.wall - self.server

    def metric(self, name: str) -> float:
        return float(getattr(self, name))


METRICS = ("wall", "network_wall", "cpu", "ours", "driver")


@dataclass
class Series:
    """The samples of one contender in one setting; `units` turns or reads per sample."""

    contender: str
    units: int
    messages: int
    samples: list[Sample] = field(default_factory=list)

    def per_unit(self, metric: str) -> list[float]:
        return [s.metric(metric) / self.units for s in self.samples]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "contender": self.contender,
            "units_per_sample": self.units,
            "messages_per_sample": self.messages,
            "samples": len(self.samples),
        }
        for metric in METRICS:
            values = self.per_unit(metric)
            scale = 1e3 if "wall" in metric else 1e6  # ms for walls, µs for CPU
            out[metric] = {
                "median": statistics.median(values) * scale,
                "min": min(values) * scale,
                "max": max(values) * scale,
            }
        for metric in ("cpu", "ours", "driver"):
            per_message = [s.metric(metric) / self.messages * 1e6 for s in self.samples]
            out[f"{metric}_us_per_message"] = statistics.median(per_message)
        trips = [s.commands for s in self.samples]
        out["round_trips_per_unit"] = (
            None if trips[0] is None else statistics.median(t or 0 for t in trips) / self.units
        )
        return out


def paired_ratio(a: Series, b: Series, metric: str) -> dict[str, float]:
    """Per sample pair (measured back to back), a / b of `metric`: median and range."""
    ratios = [
        (x.metric(metric) / a.units) / (y.metric(metric) / b.units)
        for x, y in zip(a.samples, b.samples, strict=True)
    ]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


class Deployment:
    """The database behind the latency proxy. `kind`: "wire" (embedded, own process) or "uri"."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._server = None
        if kind == "wire":
            self._server, uri = start_wire_server()
        else:
            uri = os.environ["MONGODB_URI"]
        self.upstream_uri = uri
        self.proxy = LatencyProxy(_host_port(uri))

    def close(self) -> None:
        self.proxy.close()
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(30)


def _host_port(uri: str) -> str:
    rest = uri.split("://", 1)[1]
    rest = rest.split("@", 1)[-1]
    return rest.split("/", 1)[0].split("?", 1)[0].split(",")[0]


@dataclass
class Clients:
    """An async and a sync client through the proxy, and the meter that times them."""

    async_client: Any
    sync_client: Any
    meter: Meter


@asynccontextmanager
async def connect(deployment: Deployment) -> AsyncIterator[Clients]:
    uri = deployment.proxy.uri
    async_client: Any = AsyncMongoClient(uri, tz_aware=True)
    sync_client: Any = MongoClient(uri, tz_aware=True)
    await async_client.admin.command("ping")
    sync_client.admin.command("ping")
    clock = DriverClock()
    try:
        with clock.installed():
            yield Clients(async_client, sync_client, Meter(clock, deployment.proxy))
    finally:
        await async_client.close()
        sync_client.close()


@dataclass
class Meter:
    """Times one run; the driver clock must be installed."""

    clock: DriverClock | None
    proxy: LatencyProxy | None

    async def measure(self, run: Callable[[], Awaitable[Any]]) -> Sample:
        before = self.proxy.stats() if self.proxy else ProxyStats(0, 0.0, 0.0)
        if self.clock:
            self.clock.reset()
        cpu, wall = time.process_time(), time.perf_counter()
        await run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        driver = self.clock.seconds if self.clock else 0.0
        if self.proxy is None:
            return Sample(wall, cpu, driver, None, 0.0)
        seen = self.proxy.stats() - before
        return Sample(wall, cpu, driver, seen.commands, seen.server_seconds)


def rotated(names: list[str], repetition: int) -> list[str]:
    """The contenders' order in one repetition: every one takes every place in turn."""
    shift = repetition % len(names)
    return names[shift:] + names[:shift]
