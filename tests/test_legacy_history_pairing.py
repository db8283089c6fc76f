"""A turn's `message_history_json` pairs its results with the calls they answered: the
history's calls go to the parts' calls by tool and arguments, its returns to results by their
call's id and what they say, never by position alone; a history saved early never moves a
result into an earlier turn; where history and parts disagree on a pairing, nothing is
guessed silently."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from agent_store.core import AgentMessage
from agent_store.legacy import LegacyConversion, convert

CID = "conv-w"
T0 = datetime(2021, 3, 1, 10, tzinfo=UTC)


def turn(n: int, text: str, parts: list[Any], history: list[Any] | None) -> dict[str, Any]:
    document = {
        "_id": f"t{n}",
        "conversation_id": CID,
        "user_id": "u1",
        "created_at": T0 + timedelta(minutes=n),
        "user_message": text,
        "response_parts": parts,
    }
    return document | ({"message_history_json": json.dumps(history)} if history else {})


def request(*parts: Any) -> dict[str, Any]:
    return {"kind": "request", "parts": list(parts)}


def response(*parts: Any) -> dict[str, Any]:
    return {"kind": "response", "parts": list(parts)}


def prompt(text: str) -> dict[str, Any]:
    return {"part_kind": "user-prompt", "content": text}


def h_call(call_id: str, tool: str = "weather", **args: Any) -> dict[str, Any]:
    return {"part_kind": "tool-call", "tool_name": tool, "args": args, "tool_call_id": call_id}


def h_return(call_id: str, content: str, tool: str = "weather") -> dict[str, Any]:
    return {
        "part_kind": "tool-return",
        "tool_name": tool,
        "content": content,
        "tool_call_id": call_id,
    }


def call(tool: str = "weather", call_id: str | None = None, **args: Any) -> dict[str, Any]:
    found = {"type": "tool_call", "tool_name": tool, "args": args}
    return found | ({"tool_call_id": call_id} if call_id else {})


def result(text: str, tool: str = "weather", call_id: str | None = None) -> dict[str, Any]:
    found = {"type": "tool_result", "tool_name": tool, "result": text}
    return found | ({"tool_call_id": call_id} if call_id else {})


OSLO, ROME = "Oslo: -3C snow", "Rome: 24C sunny"
ASKED = "weather in Oslo and Rome"


def answers(messages: list[AgentMessage]) -> list[tuple[str | None, str, str | None]]:
    """Each tool message as (its content, the arguments of the call it answers, that call's
    id), in order."""
    arguments = {c.id: c.function.arguments for m in messages for c in m.tool_calls or ()}
    return [
        (m.content, arguments.get(m.tool_call_id or ""), m.tool_call_id)
        for m in messages
        if m.role == "tool"
    ]


def kinds(conversion: LegacyConversion) -> list[tuple[str, bool]]:
    return [(p.kind, p.placed) for p in conversion.problems]


def test_a_result_answers_the_call_the_history_returns_it_for_whatever_the_returns_order() -> None:
    history = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo"), h_call("call_rome", city="Rome")),
        request(h_return("call_rome", ROME), h_return("call_oslo", OSLO)),
        response({"part_kind": "text", "content": "Oslo is snowy, Rome is sunny."}),
    ]
    parts = [
        call(city="Oslo"),
        result(OSLO),
        call(city="Rome"),
        result(ROME),
        {"type": "text", "content": "Oslo is snowy, Rome is sunny."},
    ]
    conversion = convert([turn(1, ASKED, parts, history)])
    assert answers(conversion.messages) == [
        (OSLO, '{"city":"Oslo"}', "call_oslo"),
        (ROME, '{"city":"Rome"}', "call_rome"),
    ]
    assert kinds(conversion) == []


def test_results_trailing_in_completion_order_answer_the_calls_the_history_returns_them_for() -> (
    None
):
    history = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo"), h_call("call_rome", city="Rome")),
        request(h_return("call_oslo", OSLO), h_return("call_rome", ROME)),
    ]
    parts = [call(city="Oslo"), call(city="Rome"), result(ROME), result(OSLO)]
    conversion = convert([turn(1, ASKED, parts, history)])
    assert sorted(answers(conversion.messages)) == [
        (OSLO, '{"city":"Oslo"}', "call_oslo"),
        (ROME, '{"city":"Rome"}', "call_rome"),
    ]
    assert kinds(conversion) == []


def test_the_historys_call_ids_go_to_the_calls_of_their_tool_and_arguments_not_by_position() -> (
    None
):
    history = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo"), h_call("call_rome", city="Rome")),
    ]
    later = [result(OSLO, call_id="call_oslo"), result(ROME, call_id="call_rome")]
    conversion = convert(
        [
            turn(1, ASKED, [call(city="Rome"), call(city="Oslo")], history),
            turn(2, "so?", [*later, {"type": "text", "content": "Snow and sun."}], None),
        ]
    )
    [calls] = [m.tool_calls for m in conversion.messages if m.tool_calls]
    assert [(c.id, c.function.arguments) for c in calls] == [
        ("call_rome", '{"city":"Rome"}'),
        ("call_oslo", '{"city":"Oslo"}'),
    ]
    assert sorted(answers(conversion.messages)) == [
        (OSLO, '{"city":"Oslo"}', "call_oslo"),
        (ROME, '{"city":"Rome"}', "call_rome"),
    ]
    assert kinds(conversion) == []


def test_equal_calls_take_the_historys_ids_of_their_tool_and_arguments_in_order() -> None:
    history = [
        request(prompt("twice")),
        response(h_call("first", city="Oslo"), h_call("other", city="Rome")),
        response(h_call("second", city="Oslo")),
    ]
    parts = [call(city="Oslo"), call(city="Rome"), call(city="Oslo")]
    conversion = convert([turn(1, "twice", parts, history)])
    ids = [c.id for m in conversion.messages for c in m.tool_calls or ()]
    assert ids == ["first", "other", "second"]


def test_an_earlier_turns_call_in_the_history_gives_its_id_to_no_later_call_alike() -> None:
    """Turn 2 is logged with the history it was given (turn 1 only), and asks what turn 1
    asked: turn 1's call, whose id turn 1 (logged without a history) never took, is not its."""
    given = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo")),
        request(h_return("call_oslo", OSLO)),
    ]
    conversion = convert(
        [
            turn(1, ASKED, [call(city="Oslo"), result(OSLO)], None),
            turn(2, "again", [call(city="Oslo"), result("Oslo: -4C")], given),
        ]
    )
    ids = [c.id for m in conversion.messages for c in m.tool_calls or ()]
    assert "call_oslo" not in ids
    assert [text for text, _, _ in answers(conversion.messages)] == [OSLO, "Oslo: -4C"]
    assert [p for p in conversion.problems if not p.placed] == []


def test_a_result_a_later_turn_logged_answers_the_earlier_call_its_history_returns_it_for() -> None:
    history = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo"), h_call("call_rome", city="Rome")),
        request(h_return("call_rome", ROME), h_return("call_oslo", OSLO)),
    ]
    conversion = convert(
        [
            turn(1, ASKED, [call(city="Oslo"), call(city="Rome")], history[:2]),
            turn(2, "so?", [result(ROME), result(OSLO)], history),
        ]
    )
    assert answers(conversion.messages) == [
        (OSLO, '{"city":"Oslo"}', "call_oslo"),
        (ROME, '{"city":"Rome"}', "call_rome"),
    ]
    assert [m.role for m in conversion.messages] == ["user", "assistant", "tool", "tool", "user"]
    assert kinds(conversion) == []


def test_among_calls_alike_a_result_the_history_tells_answers_the_one_its_place_gives_it() -> None:
    """Two calls alike; the history, saved after the first, names one call and its return.
    The result it tells answers a call alike, the one its place in the parts gives it (the
    second, whose id is generated), so the other result keeps its own call."""
    history = [
        request(prompt("twice")),
        response(h_call("h1", city="Oslo")),
        request(h_return("h1", "B1")),
    ]
    parts = [call(city="Oslo"), result("A1"), call(city="Oslo"), result("B1")]
    conversion = convert([turn(1, "twice", parts, history)])
    found = answers(conversion.messages)
    assert [(text, args) for text, args, _ in found] == [
        ("A1", '{"city":"Oslo"}'),
        ("B1", '{"city":"Oslo"}'),
    ]
    assert found[0][2] == "h1"
    assert [m.role for m in conversion.messages] == ["user", *["assistant", "tool"] * 2]
    assert [p for p in conversion.problems if not p.placed] == []


def search_history(saved_early: bool) -> list[list[Any]]:
    """Turn 1 asked P (its parts lost the result), turn 2 asked A and B; turn 2's history is
    the one it was given (earlier turns only), or one saved before B's return came."""
    first = [
        request(prompt("find P")),
        response(h_call("yP", "search", q="P")),
        request(h_return("yP", "RESULT-P", "search")),
    ]
    if not saved_early:
        return [first, first]
    return [
        first,
        [
            *first,
            request(prompt("find A and B")),
            response(h_call("xA", "search", q="A"), h_call("xB", "search", q="B")),
            request(h_return("xA", "RESULT-A", "search")),
        ],
    ]


def test_a_history_saved_early_never_moves_a_result_into_an_earlier_turn() -> None:
    for saved_early in (True, False):
        first, second = search_history(saved_early)
        parts = [
            call("search", q="A"),
            result("RESULT-A", "search"),
            call("search", q="B"),
            result("RESULT-B", "search"),
        ]
        conversion = convert(
            [
                turn(1, "find P", [call("search", q="P")], first),
                turn(2, "find A and B", parts, second),
            ]
        )
        by_turn = [(m.turn_id, m.role, m.content) for m in conversion.messages]
        asked_second = by_turn.index(("legacy-t2", "user", "find A and B"))
        assert [m for m in by_turn[:asked_second] if m[1] == "tool"] == [], saved_early
        assert [(text, args) for text, args, _ in answers(conversion.messages)] == [
            ("RESULT-A", '{"q":"A"}'),
            ("RESULT-B", '{"q":"B"}'),
        ], saved_early
        # The earlier turn's id stays its own: no call of turn 2 takes it.
        assert [k for k, _ in kinds(conversion) if k == "duplicate_tool_call_id"] == []
        ids = [c.id for m in conversion.messages for c in m.tool_calls or ()]
        assert ids[0] == "yP" not in ids[1:]
        assert ids[1:] == ["xA", "xB"] or not saved_early
        assert conversion.conversation is not None
        assert [c.tool_call_id for c in conversion.conversation.pending_calls] == ["yP"]


def test_a_pairing_the_history_contradicts_is_kept_in_a_problem_that_holds_the_drop() -> None:
    """Parts and history disagree on what two calls of one tool returned: the results answer
    the calls the parts pair them with (no history told otherwise), and a problem not placed
    keeps each result with what the history says its call returned."""
    history = [
        request(prompt(ASKED)),
        response(h_call("call_oslo", city="Oslo"), h_call("call_rome", city="Rome")),
        request(h_return("call_oslo", "Oslo: 12C"), h_return("call_rome", "Rome: 30C")),
    ]
    parts = [call(city="Oslo"), call(city="Rome"), result(ROME), result(OSLO)]
    conversion = convert([turn(1, ASKED, parts, history)])
    assert answers(conversion.messages) == [
        (ROME, '{"city":"Oslo"}', "call_oslo"),
        (OSLO, '{"city":"Rome"}', "call_rome"),
    ]
    conflicts = [p for p in conversion.problems if p.kind == "history_contradicts_pairing"]
    assert [(p.placed, p.field, p.part_index) for p in conflicts] == [
        (False, "message_history_json", 2),
        (False, "message_history_json", 3),
    ]
    assert conflicts[0].content == {
        "result": result(ROME),
        "answers": "call_oslo",
        "history_return": h_return("call_oslo", "Oslo: 12C"),
    }
    # What the history returned stays kept too, as any part no message holds.
    kept = [p.content for p in conversion.problems if p.kind == "history_only_content"]
    assert h_return("call_oslo", "Oslo: 12C") in kept


def test_one_call_of_a_tool_is_no_pairing_to_contradict() -> None:
    history = [
        request(prompt("Oslo")),
        response(h_call("call_oslo", city="Oslo")),
        request(h_return("call_oslo", "Oslo: 12C")),
    ]
    conversion = convert([turn(1, "Oslo", [call(city="Oslo"), result(OSLO)], history)])
    assert answers(conversion.messages) == [(OSLO, '{"city":"Oslo"}', "call_oslo")]
    assert kinds(conversion) == [("history_only_content", True)]


# -- the property: a history consistent with the parts changes no pairing ----------------


def consistent_conversation(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Turns of parallel calls (two tools, arguments from a small pool, so equal calls occur)
    without ids in the parts, each result right after its call, or all trailing in call order,
    or, when the history holds them all, in the order they came back; the history (the
    conversation so far, Pydantic AI's shape) names each call's real id and its return, its
    calls in any order, its returns in the order they came back, now and then saved before
    the turn's last returns, or holding only the earlier turns. Returns the turns, and what
    each call (by turn, tool and arguments) returned."""
    said: dict[str, str] = {}
    history: list[Any] = []
    turns: list[dict[str, Any]] = []
    for n in range(rng.randint(1, 3)):
        made = [(rng.choice("wv"), rng.randint(0, 2)) for _ in range(rng.randint(1, 4))]
        answer = [f"ANS{n}-{tool}-{arg}" for tool, arg in made]
        for (tool, arg), returned in zip(made, answer, strict=True):
            said[f'legacy-t{n}|{tool}{{"c":{arg}}}'] = returned
        came_back = rng.sample(range(len(made)), len(made))
        cut = rng.choice(["whole", "whole", "early", "given"])
        layout = rng.choice(["after", "call order"] + (["came back"] if cut == "whole" else []))
        parts = [call(tool, c=arg) for tool, arg in made]
        if layout == "after":
            parts = [p for k, c in enumerate(parts) for p in (c, result(answer[k], made[k][0]))]
        else:
            order = came_back if layout == "came back" else range(len(made))
            parts += [result(answer[k], made[k][0]) for k in order]
        ids = [f"id_{n}_{k}" for k in range(len(made))]
        returns = [h_return(ids[k], answer[k], made[k][0]) for k in came_back]
        calls = [h_call(ids[k], made[k][0], c=made[k][1]) for k in range(len(made))]
        given = list(history)
        history += [request(prompt(f"question {n}")), response(*rng.sample(calls, len(calls)))]
        saved = [*history, request(*returns[: rng.randint(0, len(returns) - 1)])]
        history += [request(*returns)]
        logged = {"whole": history, "early": saved, "given": given}[cut]
        turns.append(turn(n, f"question {n}", parts, list(logged)))
    return turns, said


def test_a_history_consistent_with_the_parts_leaves_every_result_answering_its_own_call() -> None:
    rng = random.Random(20261203)
    for example in range(400):
        turns, said = consistent_conversation(rng)
        conversion = convert(turns)
        calls = {
            c.id: f"{m.turn_id}|{c.function.name}{c.function.arguments}"
            for m in conversion.messages
            for c in m.tool_calls or ()
        }
        found = [
            (said[calls[m.tool_call_id or ""]], m.content)
            for m in conversion.messages
            if m.role == "tool"
        ]
        assert [a for a, b in found if a != b] == [], (example, turns)
        results = [p for t in turns for p in t["response_parts"] if p["type"] == "tool_result"]
        assert len(found) == len(results), (example, turns)
        assert [p for p in conversion.problems if not p.placed] == [], (example, turns)
        assert [k for k, _ in kinds(conversion) if k == "duplicate_tool_call_id"] == []


def numbered_turn(cities: list[str], before: list[Any], asked: str) -> list[Any]:
    """A turn's history whose provider numbers call ids per response (`call_0`, `call_1`, …
    in every response), its returns in reverse order."""
    ids = [f"call_{k}" for k in range(len(cities))]
    return [
        *before,
        request(prompt(asked)),
        response(*[h_call(i, city=c) for i, c in zip(ids, cities, strict=True)]),
        request(
            *[
                h_return(i, f"{c}: weather")
                for i, c in reversed(list(zip(ids, cities, strict=True)))
            ]
        ),
        response({"part_kind": "text", "content": "ok " + asked}),
    ]


def test_ids_numbered_per_turn_still_pair_each_result_with_the_call_its_turns_history_names() -> (
    None
):
    first = numbered_turn(["Oslo", "Rome"], [], "q1")
    second = numbered_turn(["Paris", "Berlin"], first, "q2")
    conversion = convert(
        [
            turn(
                1,
                "q1",
                [
                    call(city="Oslo"),
                    call(city="Rome"),
                    result("Rome: weather"),
                    result("Oslo: weather"),
                ],
                first,
            ),
            turn(
                2,
                "q2",
                [
                    call(city="Paris"),
                    call(city="Berlin"),
                    result("Berlin: weather"),
                    result("Paris: weather"),
                ],
                second,
            ),
        ]
    )
    assert sorted((text, args) for text, args, _ in answers(conversion.messages)) == [
        ("Berlin: weather", '{"city":"Berlin"}'),
        ("Oslo: weather", '{"city":"Oslo"}'),
        ("Paris: weather", '{"city":"Paris"}'),
        ("Rome: weather", '{"city":"Rome"}'),
    ]
    assert all(
        placed and kind != "history_contradicts_pairing" for kind, placed in kinds(conversion)
    )


def test_ids_numbered_per_response_pair_each_return_with_the_call_of_its_own_response() -> None:
    history = [
        request(prompt(ASKED)),
        response(h_call("call_0", city="Oslo"), h_call("call_1", city="Rome")),
        request(h_return("call_1", ROME), h_return("call_0", OSLO)),
        response(h_call("call_0", city="Paris"), h_call("call_1", city="Berlin")),
        request(h_return("call_1", "Berlin: 9C"), h_return("call_0", "Paris: 12C")),
        response({"part_kind": "text", "content": "done"}),
    ]
    parts = [
        call(city="Oslo"),
        call(city="Rome"),
        result(ROME),
        result(OSLO),
        call(city="Paris"),
        call(city="Berlin"),
        result("Berlin: 9C"),
        result("Paris: 12C"),
        {"type": "text", "content": "done"},
    ]
    conversion = convert([turn(1, ASKED, parts, history)])
    assert sorted((text, args) for text, args, _ in answers(conversion.messages)) == [
        ("Berlin: 9C", '{"city":"Berlin"}'),
        (OSLO, '{"city":"Oslo"}'),
        ("Paris: 12C", '{"city":"Paris"}'),
        (ROME, '{"city":"Rome"}'),
    ]
    assert all(
        placed and kind != "history_contradicts_pairing" for kind, placed in kinds(conversion)
    )
