"""Tables and verdicts of `make bench`, printed from the report it writes."""

from __future__ import annotations

from typing import Any

TARGET_LATENCY = "1"
GOALS = {
    "round_trips": 2,
    "vs_langchain_network_wall": 0.6,
    "vs_raw_two_network_wall": 1.1,
    "vs_raw_two_cpu": 1.3,
    "ours_per_turn_us": 100.0,
    "ours_per_message_us": 15.0,
    "growth": 1.2,
    "transcript_cpu": 1.15,
}


def _range(r: dict[str, float], unit: str = "x") -> str:
    return f"{r['median']:.2f}{unit} ({r['min']:.2f}-{r['max']:.2f})"


def _contender_rows(rows: list[dict[str, Any]], unit: str) -> None:
    print(
        f"   {'contender':<12}{'wall ms/' + unit:>14}{'range':>14}{'net ms':>9}{'trips':>7}"
        f"{'CPU us/msg':>11}{'ours':>7}{'driver':>8}{'ours us/' + unit:>14}"
    )
    for row in rows:
        trips = row["round_trips_per_unit"]
        wall = row["wall"]
        print(
            f"   {row['contender']:<12}{wall['median']:>14.2f}"
            f"{wall['min']:>7.2f}-{wall['max']:<6.2f}{row['network_wall']['median']:>9.2f}"
            f"{'—' if trips is None else f'{trips:.2f}':>7}{row['cpu_us_per_message']:>11.0f}"
            f"{row['ours_us_per_message']:>7.0f}{row['driver_us_per_message']:>8.0f}"
            f"{row['ours']['median']:>14.0f}"
        )


def _print_writes(data: dict[str, Any]) -> None:
    print(
        f"\n== writes: {data['conversations']} conversations, {data['turns']} turns, "
        f"{data['messages']} messages per repetition, {data['repetitions']} repetitions"
    )
    for latency, block in data["by_latency_ms"].items():
        print(f"  round-trip latency {latency} ms")
        _contender_rows(block["contenders"], "turn")
        for label, metrics in block["ratios"].items():
            shown = ", ".join(f"{m} {_range(r)}" for m, r in metrics.items())
            print(f"   {label:<24} {shown}")


def _print_growth(data: dict[str, Any]) -> None:
    print(f"\n== growth: cost per turn by turn number, {data['latency_ms']:g} ms round trips")
    print(
        f"   {'contender':<11}{'turn':>6}{'ours us':>10}{'driver us':>11}"
        f"{'net ms':>9}{'wall ms':>9}"
    )
    for name, block in data["contenders"].items():
        for turn, values in block["at_turn"].items():
            control = values.get("control_ours")
            print(
                f"   {name:<11}{turn:>6}{values['ours']:>10.0f}{values['driver']:>11.0f}"
                f"{values['network_wall']:>9.2f}{values['wall']:>9.2f}"
                + (
                    ""
                    if control is None
                    else f"   control turn {control:.0f} us, ours/control "
                    f"{values['ours_vs_control']:.2f}"
                )
            )
    if "logger_controlled_last_vs_turn_10" in data:
        print(
            f"   logger ours, last turn / turn 10: {data['logger_ours_last_vs_turn_10']:.2f}x "
            f"as measured, {data['logger_controlled_last_vs_turn_10']:.2f}x against the controls"
        )


def _print_sizes(data: dict[str, Any]) -> None:
    print(f"\n== sizes: {data['turns_per_size']} turns of each size, client CPU per turn (µs)")
    print(
        f"   {'msgs/turn':>9}{'logger ours':>13}{'less harness':>14}{'logger driver':>15}"
        f"{'raw two driver':>16}"
    )
    for row in data["rows"]:
        print(
            f"   {row['messages_per_turn']:>9}{row['logger']['ours']['median']:>13.0f}"
            f"{row['logger_ours_net_us']:>14.0f}"
            f"{row['logger']['driver']['median']:>15.0f}{row['raw two']['driver']['median']:>16.0f}"
        )
    fit = data["logger_ours_fit_us"]
    print(
        f"   our code (logger's ours less the harness, i.e. raw two's ours): "
        f"{fit['per_turn']:.0f} µs per turn + {fit['per_message']:.1f} µs per message"
    )


def _print_reads(data: dict[str, Any]) -> None:
    print(f"\n== reads: a {data['messages']}-message transcript")
    _contender_rows(data["contenders"], "read")
    for label, metrics in data["ratios"].items():
        print(f"   {label:<24} " + ", ".join(f"{m} {_range(r)}" for m, r in metrics.items()))
    print(f"   checks: {data['checks']}")


def _print_loops(data: dict[str, Any]) -> None:
    print("\n== event loop: client CPU µs per message")
    for what in ("logger", "transcript"):
        cpu = data[f"{what}_cpu_us_per_message"]
        print(
            f"   {what:<11} asyncio {cpu['asyncio']:.0f}, uvloop {cpu['uvloop']:.0f}: "
            f"uvloop/asyncio {_range(data[f'uvloop_vs_asyncio_{what}'])}"
        )


def _print_verdicts(report: dict[str, Any]) -> None:
    print("\n== targets (ratios measured in this run; median, per-repetition range)")
    for goal, value, met in report["verdicts"]:
        verdict = "n/a" if met is None else ("met" if met else "MISSED")
        print(f"  {goal:<66} {value:>38}  {verdict}")


def print_section(name: str, data: dict[str, Any]) -> None:
    printers = {
        "writes": _print_writes,
        "growth": _print_growth,
        "sizes": _print_sizes,
        "reads": _print_reads,
        "reads_mongomock": _print_reads,
        "loops": _print_loops,
        "verdicts": _print_verdicts,
    }
    if name == "reads_mongomock":
        print("\n(mongomock: the database runs in this process; its CPU is in every figure)")
    printers[name](data)


def verdicts(report: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    found: list[tuple[str, str, bool | None]] = []
    writes = report.get("writes", {}).get("by_latency_ms", {})
    at = writes.get(TARGET_LATENCY)
    if at:
        logger = next(c for c in at["contenders"] if c["contender"] == "logger")
        trips = logger["round_trips_per_unit"]
        found.append((f"logger round trips per turn = {GOALS['round_trips']}", f"{trips:g}",
                      trips == GOALS["round_trips"]))  # fmt: skip
        for other, metric, goal, label in (
            ("langchain", "network_wall", "vs_langchain_network_wall", "network wall"),
            ("raw two", "network_wall", "vs_raw_two_network_wall", "network wall"),
            ("raw two", "cpu", "vs_raw_two_cpu", "client CPU per message"),
        ):
            ratio = at["ratios"].get(f"logger / {other}", {}).get(metric)
            floor = at["ratios"].get(f"raw two / {other}", {}).get(metric)
            if ratio:
                found.append((
                    f"logger {label} <= {GOALS[goal]}x {other} at {TARGET_LATENCY} ms",
                    _range(ratio) + (f"; raw two {floor['median']:.2f}x" if floor else ""),
                    ratio["median"] <= GOALS[goal],
                ))  # fmt: skip
    if "sizes" in report:
        fit = report["sizes"]["logger_ours_fit_us"]
        met = (fit["per_turn"] <= GOALS["ours_per_turn_us"]
               and fit["per_message"] <= GOALS["ours_per_message_us"])  # fmt: skip
        found.append((
            f"our code <= {GOALS['ours_per_turn_us']:.0f} us/turn + "
            f"{GOALS['ours_per_message_us']:.0f} us/message",
            f"{fit['per_turn']:.0f} + {fit['per_message']:.1f}", met,
        ))  # fmt: skip
    growth = report.get("growth", {}).get("logger_controlled_last_vs_turn_10")
    if growth is not None:
        turns = report["growth"]["contenders"]["logger"]["turns"]
        raw = report["growth"]["logger_ours_last_vs_turn_10"]
        found.append((
            f"our code per turn at turn {turns} <= {GOALS['growth']}x turn 10 (vs controls)",
            f"{growth:.2f}x (raw {raw:.2f}x)", growth <= GOALS["growth"],
        ))  # fmt: skip
    for key, where in (("reads", "wire"), ("reads_mongomock", "mongomock")):
        if key in report:
            ratio = report[key]["ratios"]["transcript / raw find"]["cpu"]
            found.append((
                f"transcript client CPU <= {GOALS['transcript_cpu']}x raw find ({where})",
                _range(ratio), ratio["median"] <= GOALS["transcript_cpu"],
            ))  # fmt: skip
    return found


def _md_writes(report: dict[str, Any]) -> list[str]:
    lines = [
        "| round trip | contender | wall ms/turn (range) | network wall ms/turn | round trips/turn "
        "| client CPU µs/msg | ours | driver |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for latency, block in report["writes"]["by_latency_ms"].items():
        for row in block["contenders"]:
            wall = row["wall"]
            lines.append(
                f"| {latency} ms | {row['contender']} | {wall['median']:.2f} "
                f"({wall['min']:.2f}-{wall['max']:.2f}) | {row['network_wall']['median']:.2f} | "
                f"{row['round_trips_per_unit']:.2f} | {row['cpu_us_per_message']:.0f} | "
                f"{row['ours_us_per_message']:.0f} | {row['driver_us_per_message']:.0f} |"
            )
    return lines


def _md_growth(report: dict[str, Any]) -> list[str]:
    lines = [
        "| contender | turn | ours µs/turn | driver µs/turn | network wall ms | wall ms "
        "| control turn: ours µs | ours / control |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, block in report["growth"]["contenders"].items():
        for turn, v in block["at_turn"].items():
            control = v.get("control_ours")
            extra = (
                "| — | — |"
                if control is None
                else f"| {control:.0f} | {v['ours_vs_control']:.2f} |"
            )
            lines.append(
                f"| {name} | {turn} | {v['ours']:.0f} | {v['driver']:.0f} | "
                f"{v['network_wall']:.2f} | {v['wall']:.1f} " + extra
            )
    return lines


def _md_sizes(report: dict[str, Any]) -> list[str]:
    lines = [
        "| messages/turn | logger: ours µs/turn | less the harness | logger: driver µs/turn "
        "| raw two: driver µs/turn |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in report["sizes"]["rows"]:
        lines.append(
            f"| {row['messages_per_turn']} | {row['logger']['ours']['median']:.0f} | "
            f"{row['logger_ours_net_us']:.0f} | {row['logger']['driver']['median']:.0f} | "
            f"{row['raw two']['driver']['median']:.0f} |"
        )
    return lines


def _md_reads(report: dict[str, Any]) -> list[str]:
    lines = [
        "| stand-in | reader | wall ms/read (range) | client CPU µs/msg | ours | driver |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for key, where in (("reads", "mongoeco wire"), ("reads_mongomock", "mongomock")):
        for row in report.get(key, {}).get("contenders", []):
            wall = row["wall"]
            driver = "—" if key == "reads_mongomock" else f"{row['driver_us_per_message']:.0f}"
            ours = "—" if key == "reads_mongomock" else f"{row['ours_us_per_message']:.0f}"
            lines.append(
                f"| {where} | {row['contender']} | {wall['median']:.1f} "
                f"({wall['min']:.1f}-{wall['max']:.1f}) | {row['cpu_us_per_message']:.1f} | "
                f"{ours} | {driver} |"
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report's tables and verdicts in Markdown (docs/BENCHMARKS.md quotes them)."""
    machine = report["machine"]
    out = [
        f"Run {report['date']} on {machine['cpu']} ({machine['cpus']} CPUs), Python "
        f"{machine['python']}, PyMongo {machine['pymongo']}, event loop {report.get('loop')}; "
        f"load average {report['load_average_before'][0]:.2f} before, "
        f"{report['load_average_after'][0]:.2f} after; {report['seconds']} s.",
        "",
    ]
    for title, section, build in (
        ("Writes", "writes", _md_writes),
        ("Growth with the conversation", "growth", _md_growth),
        ("Growth with the turn", "sizes", _md_sizes),
        ("Reads", "reads", _md_reads),
    ):
        if section in report:
            out += [f"**{title}**", "", *build(report), ""]
    out += ["**Targets**", "", "| target | measured | verdict |", "|---|---:|---|"]
    for goal, value, met in report["verdicts"]:
        out.append(f"| {goal} | {value} | {'n/a' if met is None else 'met' if met else 'missed'} |")
    return "\n".join(out)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
