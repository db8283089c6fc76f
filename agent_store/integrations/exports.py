"""Replay-safe exports of stored conversations, and the checker of the pairing rules they keep.

- `chat_completions`: OpenAI Chat Completions messages, extensions removed,
  every tool call answered right after the message that makes it.
- `responses_items`: the same history as OpenAI Responses input items.
- `conversation_jsonl`, `user_jsonl`: every stored field, one JSON document a line.

Pure, except `user_jsonl`, which reads through a `ConversationStore`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from agent_store.core import (
    PENDING_RESULT,
    AgentMessage,
    AssistantMessage,
    InvalidInput,
    ToolMessage,
    describe_validation_error,
    messages_adapter,
    result_text,
)
from agent_store.integrations._pairing import CallKey, answers_to_calls, unique_call_id
from agent_store.store import (
    DEFAULT_MARKERS,
    ConversationExport,
    ConversationStore,
    RuntimeContextMarkers,
    holds_a_persons_words,
    prompt_text,
    strip_runtime_context,
)

Dangling = Literal["synthesize", "drop"]
"""For a call no stored result answers (a pending call): `PENDING_RESULT` answers it in the
export, or the call is dropped from it."""


_ALLOWED_KEYS = {
    "system": {"role", "content", "name"},
    "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "tool_calls", "name", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}


def as_messages(messages: Sequence[AgentMessage | Mapping[str, Any]]) -> list[AgentMessage]:
    """A conversation's messages as models, of any length: models as they are, mappings (stored
    documents) validated; InvalidInput naming the one that is not a message."""
    try:
        return messages_adapter.validate_python(list(messages))
    except ValidationError as exc:
        raise InvalidInput(describe_validation_error(exc, subject="conversation")) from exc


def chat_completions(
    messages: Sequence[AgentMessage | Mapping[str, Any]],
    *,
    dangling: Dangling = "synthesize",
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
) -> list[dict[str, Any]]:
    """A stored conversation as OpenAI Chat Completions messages that replay without errors.

    Only `role`, `content`, `tool_calls` and `tool_call_id` are kept. Each
    call's result follows the assistant message that makes it (results stored
    later are moved up, and a real result stored later wins over an
    `interrupted` stand-in); a result that answers no call is left out; a call
    with no stored result — a pending call — gets `PENDING_RESULT` in the
    export only or, with `dangling="drop"`, is removed; a result stored with
    no text and an error says the call failed and why (`result_text`). A call id used again
    later in the conversation is renamed `<id>_<n>` so ids stay unique.
    Assistant messages the model never said — an `error` or a HITL action
    with no text, or no text once its calls were dropped — are left out, and
    a user message with only an upload (no text, or none once its hidden
    context is removed) becomes a short note naming the file.
    Hidden runtime context (between `markers`) is removed from user text, as
    the logger does, should the messages not come from the store.
    """
    if dangling not in ("synthesize", "drop"):
        raise InvalidInput(f"invalid dangling {dangling!r}: use 'synthesize' or 'drop'")
    stored = as_messages(messages)
    answers = answers_to_calls(stored)
    used_ids: set[str] = set()
    exported: list[dict[str, Any]] = []
    for index, message in enumerate(stored):
        if isinstance(message, AssistantMessage):
            exported += _exported_response(index, message, answers, used_ids, dangling)
        elif not isinstance(message, ToolMessage):  # a tool message goes with its call
            exported += _exported_prompt(message, markers)
    return exported


def _exported_prompt(message: AgentMessage, markers: RuntimeContextMarkers) -> list[dict[str, Any]]:
    """A system or user message: its text, or a note naming an uploaded file when nothing of
    its text is left once hidden context is removed (`prompt_text`; from a person's words
    only, `holds_a_persons_words`: a tool's content or retry feedback is sent whole)."""
    if message.content and holds_a_persons_words(message):
        shown = strip_runtime_context(message.content, markers)
        if shown != message.content:
            message = message.model_copy(update={"content": shown})
    text = prompt_text(message)
    return [] if text is None else [{"role": message.role, "content": text}]


def _exported_response(
    index: int,
    message: AssistantMessage,
    answers: dict[CallKey, ToolMessage],
    used_ids: set[str],
    dangling: Dangling,
) -> list[dict[str, Any]]:
    """An assistant message followed by the answer of each of its calls."""
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for call in message.tool_calls or ():
        answer = answers.get((index, call.id))
        if answer is None and dangling == "drop":
            continue
        call_id = unique_call_id(call.id, used_ids)
        function = {"name": call.function.name, "arguments": call.function.arguments}
        calls.append({"id": call_id, "type": "function", "function": function})
        content = PENDING_RESULT if answer is None else result_text(answer)
        results.append({"role": "tool", "tool_call_id": call_id, "content": content})
    if not message.content and not calls:
        return []  # nothing the model said is left
    response = {"role": "assistant", "content": message.content}
    return [response | ({"tool_calls": calls} if calls else {}), *results]


def responses_items(
    messages: Sequence[AgentMessage | Mapping[str, Any]],
    *,
    dangling: Dangling = "synthesize",
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
) -> list[dict[str, Any]]:
    """The conversation as OpenAI Responses input items, paired as `chat_completions` pairs them.

    Items are `message` (role and text), `function_call` and `function_call_output`.
    """
    items: list[dict[str, Any]] = []
    for message in chat_completions(messages, dangling=dangling, markers=markers):
        if message["role"] == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message["tool_call_id"],
                    "output": message["content"],
                }
            )
            continue
        if message["content"]:
            items.append(
                {"type": "message", "role": message["role"], "content": message["content"]}
            )
        for call in message.get("tool_calls", ()):
            items.append(
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                }
            )
    return items


class _ReplayCheck:
    """Walks a Chat Completions history once, noting every rule it breaks."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.seen_ids: set[str] = set()
        self.waiting: set[str] = set()
        self.answerable: set[str] = set()

    def close(self, at: str) -> None:
        if self.waiting:
            self.problems.append(f"{at}: tool calls {sorted(self.waiting)} are left unanswered")
            self.waiting.clear()
        self.answerable.clear()

    def message(self, where: str, message: Any) -> None:
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in _ALLOWED_KEYS:
            self.problems.append(f"{where}: unknown role {role!r}")
            return
        extra = set(message) - _ALLOWED_KEYS[role]
        if extra:
            self.problems.append(f"{where}: keys the API does not take: {sorted(extra)}")
        if role == "tool":
            self.tool(where, message)
            return
        self.close(f"before {where}")
        if role == "assistant":
            self.assistant(where, message)
        elif not isinstance(message.get("content"), str):
            self.problems.append(f"{where}: a {role} message needs string content")

    def tool(self, where: str, message: Mapping[str, Any]) -> None:
        call_id = message.get("tool_call_id")
        if not isinstance(message.get("content"), str):
            self.problems.append(f"{where}: a tool message needs string content")
        if call_id not in self.answerable:
            self.problems.append(
                f"{where}: tool message for {call_id!r} answers no call of the "
                "assistant message right before it"
            )
        elif call_id not in self.waiting:
            self.problems.append(f"{where}: tool call {call_id!r} is answered twice")
        self.waiting.discard(call_id)

    def assistant(self, where: str, message: Mapping[str, Any]) -> None:
        content, calls = message.get("content"), message.get("tool_calls")
        if calls is None:
            if not isinstance(content, str):
                self.problems.append(f"{where}: an assistant message needs content or tool calls")
            return
        if content is not None and not isinstance(content, str):
            self.problems.append(f"{where}: assistant content must be a string or null")
        if not isinstance(calls, list) or not calls:
            self.problems.append(f"{where}: tool_calls must be a non-empty list")
            return
        for call in calls:
            problem = _call_problem(call)
            if problem:
                self.problems.append(f"{where}: {problem}")
                continue
            if call["id"] in self.seen_ids:
                self.problems.append(f"{where}: tool call id {call['id']!r} is used again")
            self.seen_ids.add(call["id"])
            self.waiting.add(call["id"])
            self.answerable.add(call["id"])


def chat_completions_problems(messages: Sequence[Any]) -> list[str]:
    """Every way a Chat Completions history breaks the API's rules; empty when it replays.

    The rules: only the API's keys per role; tool calls well formed with ids
    unique in the history; the messages right after an assistant message with
    tool calls are tool messages answering each of those calls exactly once,
    and nothing else is a tool message.
    """
    check = _ReplayCheck()
    for index, message in enumerate(messages):
        check.message(f"message {index}", message)
    check.close("at the end")
    return check.problems


def _call_problem(call: Any) -> str | None:
    if not isinstance(call, Mapping) or set(call) != {"id", "type", "function"}:
        return "a tool call needs exactly `id`, `type` and `function`"
    function = call["function"]
    if not isinstance(call["id"], str) or not call["id"] or call["type"] != "function":
        return "a tool call needs a string id and type 'function'"
    if not isinstance(function, Mapping) or set(function) != {"name", "arguments"}:
        return "a tool call's function needs exactly `name` and `arguments`"
    if not function["name"] or not isinstance(function["arguments"], str):
        return "a tool call's function needs a name and string arguments"
    return None


def check_chat_completions(messages: Sequence[Any]) -> None:
    """Raise InvalidInput listing every broken rule (see `chat_completions_problems`)."""
    problems = chat_completions_problems(messages)
    if problems:
        raise InvalidInput("history does not replay: " + "; ".join(problems))


# -- JSONL ----------------------------------------------------------------------------


def conversation_jsonl(export: ConversationExport) -> Iterator[str]:
    """A conversation as JSON lines: `{"conversation": …}`, then `{"message": …}` by `seq`."""
    yield _line({"conversation": export.conversation.model_dump(mode="json", by_alias=True)})
    for message in export.messages:
        yield _line({"message": message.model_dump(mode="json", by_alias=True)})


async def user_jsonl(store: ConversationStore, user_id: str) -> AsyncIterator[str]:
    """All of a user's data as JSON lines, conversation after conversation (see `export_user`)."""
    async for export in store.export_user(user_id):
        for line in conversation_jsonl(export):
            yield line


def _line(document: dict[str, Any]) -> str:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n"
