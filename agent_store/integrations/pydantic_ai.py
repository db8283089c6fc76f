"""Pydantic AI runs in, Pydantic AI history out. Pure converters, plus one logging call.

`messages_from_run(result.new_messages())` gives the stored messages of a
turn; `history_from_messages(await store.transcript(cid))` gives back the
`message_history` for the next run, so a runtime keeps no cache and no
per-turn history blob. Needs the `pydantic-ai` extra; the rest of the
package does not import this module.

What the OpenAI-format store keeps of each part (see README, "Runtime integration"):

- system prompt, user prompt, text, tool call (with Pydantic AI's own
  `tool_call_id`), tool return: as the matching OpenAI message, one assistant
  message per model response with `token_usage` and `latency_ms` (the time
  from the request being sent to the response). A response's several texts are
  one `content` joined with a blank line, as Pydantic AI's OpenAI Chat mapping
  sends them, and kept apart as OpenAI content parts in `native` (format
  `pydantic-ai`), so the history gives back each text part.
- a prompt's text items (`str`, `TextContent`, `StructuredContent`): the text
  the model is sent, one line each; a `CachePoint` adds nothing.
- content a tool returned for the model (`ToolReturn(content=...)`, sent as a
  user prompt after the tool returns): a `user` message marked
  `error: {message: "tool content"}`: it is the tool's text, never a person's. A run
  resumed with `deferred_tool_results` and a `user_prompt` sends that prompt after
  it, alike: `log_run` takes the last of them for the person's unless told the run
  had none (`user_prompt=None`).
- a tool return that is not a success (`failed`, `denied`, `interrupted`,
  `retried` — a tool retry prompt is a retried return): a `tool` message with
  the content the model was shown and an `error` marker naming the outcome,
  so it still answers its call in any replay.
- retry feedback that answers no call (an output retry): a `user` message
  marked `error: {message: "retry feedback: <cause>"}`, because the model
  receives it in the user's voice; it is never shown as a person's words.
- a tool result's, a tool retry's or retry feedback's content: as the text the
  model is sent (a value as its JSON); `native` says whether it was a `str` or a
  value (`content_kind`) when the text alone reads otherwise, so the history
  gives back what the run held; an output tool's `tool_kind` is kept too.
- a call the run left unanswered (a tool that requires approval, or a
  deferred call: the run ended with `DeferredToolRequests`): stored without
  an answer, so the conversation lists it as pending; the next run's return
  for it (`deferred_tool_results`) is stored as its answer. A call the run left
  unanswered for good (its response `interrupted`: a cancelled stream, a usage limit
  crossed; or the run cut off while its tools ran) is answered `interrupted`, as
  Pydantic AI closes it before a new prompt: closed, never run, never pending.
- thinking: not stored. It is the model's private reasoning, not part of the
  conversation; providers drop or re-sign it across turns, and storing it as
  content would replay it as if the model had said it.
- a system prompt's fields beyond its text (a dynamic prompt's `dynamic_ref`):
  in `native` of its system message, so Pydantic AI evaluates it again on the
  next run, as from memory.
- what Pydantic AI holds for the application and never sends the model: a tool's
  `ui_visibility` on its call (in the response's kept parts) and its return, a
  request's and a response's `metadata` and `conversation_id` (the request's on the
  first message stored of it), a response's usage beyond its input and output tokens,
  the model, provider and finish reason of it and its `state` when `interrupted`
  (not its `provider_response_id` or `provider_details`, server-side state), a text's
  `citations`, a retry's `attempt` and `max_retries`, a prompt `TextContent`'s
  `metadata` (the prompt's lines apart): in
  `native`, given back where the run held it, so a UI adapter shows a reloaded
  chat as it was streamed.
- a response part the chat fields have no place for (a provider's own tool
  call and its return — web search, code execution —, a compaction, a spoken
  reply without its audio): kept whole in `native` (`parts`, the response's
  parts in order, one the chat fields hold as a stand-in naming its kind) and
  given back in its place; the chat fields hold the text and only the calls
  the runtime's tools answer.
- framework bookkeeping parts of a request (instruction and capability
  deltas, a compaction the application wrote) are not stored; a file in a user
  prompt or in a tool's result is kept as a `[kind]` note (`[binary]`,
  `[image-url]`, …) in its place, and a file the model produced as a
  `[file <media type>]` note in its text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from enum import Enum
from typing import Any, cast

import pydantic_core
from pydantic import TypeAdapter, ValidationError

try:
    from pydantic_ai import DeferredToolResults
    from pydantic_ai import messages as pai
    from pydantic_ai.usage import RequestUsage
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "agent_store.integrations.pydantic_ai needs Pydantic AI: "
        "install agent-conversation-store[pydantic-ai]"
    ) from exc

from agent_store.core import (
    MAX_PARAMS_DEPTH,
    AgentMessage,
    AssistantMessage,
    FunctionCall,
    NativeForm,
    SystemMessage,
    TokenUsage,
    ToolCall,
    ToolMessage,
    UserMessage,
    feedback_cause,
    feedback_error,
    nests_deeper_than,
    outcome_error,
    result_text,
    stand_in_result,
    tool_content_error,
    tool_outcome,
    utc_now,
    whole_millis,
)
from agent_store.integrations._answering import log_answering
from agent_store.integrations._native import kept_form, native_form, runtime_json, with_native
from agent_store.integrations._pairing import (
    CallKey,
    answers_to_calls,
    pending_stand_in,
    unique_call_id,
)
from agent_store.integrations.exports import as_messages
from agent_store.store import (
    DEFAULT_MARKERS,
    AgentMessageLogger,
    LoggedTurn,
    RuntimeContextMarkers,
    prompt_text,
    strip_runtime_context,
    strip_runtime_context_pieces,
)

__all__ = ["history_from_messages", "log_run", "messages_from_run"]

_log = logging.getLogger("agent_store.integrations.pydantic_ai")

FORMAT = "pydantic-ai"
"""The `native.format` of what the chat fields cannot hold of a part: a response's several
texts (as content parts) and its parts' order with the parts kept whole, a system prompt's
fields beyond its text."""
_TEXTS_JOINED = "\n\n"
"""How several texts of one response are joined in its stored `content`: as Pydantic AI's
OpenAI Chat mapping joins them for the model, so a chat-format reader gives the same text."""

_SYSTEM_PROMPT: TypeAdapter[pai.SystemPromptPart] = TypeAdapter(pai.SystemPromptPart)
_RESPONSE_PART: TypeAdapter[pai.ModelResponsePart] = TypeAdapter(pai.ModelResponsePart)
_IN_CHAT_FIELDS = ("text", "tool-call")
"""The stand-ins, in a response's kept order, for a part the chat fields hold: a text (or a
file's note), a call; taken from `content` and `tool_calls` in turn."""

_CONTENT_KIND = "content_kind"
"""The `native` key of a tool result or retry feedback saying what the part's content was:
`text` (a `str`: given back as the stored text) or `value` (given back as the value the stored
text is the JSON of; no text as None, or as the value kept whole as `content`: `[]`, which
Pydantic AI renders as no text too). Kept only when the text alone reads otherwise
(`_plain_kind`): a `str` holding JSON, or a value Pydantic AI renders as no JSON (`[]`, None)."""

_TOOL_RETRY_CAUSES: dict[str, pai.ToolRetryCause] = {
    cause: cause
    for cause in ("validation_error", "model_retry", "unknown_tool", "unavailable_tool")
}
_FEEDBACK_CAUSES: dict[str, pai.RetryFeedbackCause] = {
    cause: cause for cause in ("validation_error", "no_output", "model_retry")
}
_UI_VISIBILITIES: dict[str, pai.ToolUIVisibility] = {
    seen: seen for seen in ("public", "redacted", "private")
}
"""What a UI adapter sends a client of a tool's call and return (`ui_visibility`), stamped on
both parts: the application's, never sent to the model."""
_USAGE: TypeAdapter[RequestUsage] = TypeAdapter(RequestUsage)
_RESPONSE: TypeAdapter[pai.ModelResponse] = TypeAdapter(pai.ModelResponse)
_IN_TOKEN_USAGE = {"input_tokens", "output_tokens"}
"""The usage fields `token_usage` holds; `native` keeps the others (`usage`)."""
_ACCOUNTING = ("model_name", "provider_name", "provider_url", "finish_reason")
"""A response's fields kept in `native` beside its usage: which model and provider answered,
and why it stopped. The application's accounting (`ModelResponse.cost()`), never sent to the
model. Not its `provider_response_id` or `provider_details`: they name state on the
provider's servers, which a model given them back would continue (a `previous_response_id`)
rather than be sent the history."""
_IN_RUN = ("state", "conversation_id")
"""A response's fields kept in `native` beside its accounting, for the run that continues the
history: its `state` when `interrupted` (the run stopped before acting on it; a `suspended`
one comes back finished, its `provider_response_id` not kept) and the `conversation_id` a
run given the history takes on. Never sent to the model."""
_REQUEST_METADATA = "request_metadata"
"""The `native` key, on the first message stored of a request, of the request's `metadata`."""
_CONVERSATION_ID = "conversation_id"
"""The `native` key, on the first message stored of a request, of its `conversation_id`."""
_RETRY_BUDGET = "retry"
"""The `native` key of a retry's `attempt` and `max_retries` (`RetryInfo`): for the
application only; its `cause` is in the `error` marker."""
_CITATIONS: TypeAdapter[list[pai.Citation]] = TypeAdapter(list[pai.Citation])


# -- a run into stored messages -------------------------------------------------------


def messages_from_run(
    messages: Sequence[pai.ModelMessage],
    *,
    markers: RuntimeContextMarkers = DEFAULT_MARKERS,
    resumed: Collection[str] = (),
    prompted: bool = True,
) -> list[AgentMessage]:
    """The stored messages of an agent run's messages (`result.new_messages()`), in order.

    Hidden runtime context (between `markers`) is removed from each user
    prompt, its text items read as one text, so a block or a marker cut
    across items is removed too; a tool's content and retry feedback, which
    are no person's words, are kept whole, as the model was sent them. A run resumed
    with `deferred_tool_results` sends its tools' content, then its `user_prompt`
    when it was given one, as user prompts after its returns, alike: `prompted` (the
    default) takes the last of them for the person's, `prompted=False` none of them. A
    call id the provider used again within the run is renamed `<id>_<n>` (with its
    result), and a warning logged. `resumed` names the calls of an earlier run this run was
    resumed on (the ids its `deferred_tool_results` answers): cut off before its
    first response, the run closes those it returned nothing for.
    """
    stored: list[AgentMessage] = []
    sent_at: datetime | None = None
    for index, message in enumerate(messages):
        subject = f"message {index} ({message.kind})"
        if isinstance(message, pai.ModelRequest):
            from_tools = _tool_content(message, prompted=prompted and sent_at is None)
            sent_at, first = message.timestamp, len(stored)
            for part in message.parts:
                from_tool = id(part) in from_tools
                stored.extend(_from_request_part(part, markers, subject, from_tool=from_tool))
            kept = {_REQUEST_METADATA: message.metadata, _CONVERSATION_ID: message.conversation_id}
            kept = {key: value for key, value in kept.items() if value is not None}
            if kept and len(stored) > first:
                stored[first] = _with_kept(stored[first], kept, subject)
        else:
            stored.append(_from_response(message, sent_at, subject))
    closed = _closed_for_good(messages, stored, resumed)
    return _with_unique_call_ids([*stored, *closed])


def _closed_for_good(
    messages: Sequence[pai.ModelMessage], stored: Sequence[AgentMessage], resumed: Collection[str]
) -> list[ToolMessage]:
    """An `interrupted` answer to each call that the run left unanswered for good, as
    Pydantic AI closes them (`_repair_interrupted_tail`): the calls of its last response, or
    of the earlier run it was `resumed` on when it holds no response of its own. The run
    was cut off after the response (an `interrupted` request: its tools were running) or
    stopped before acting on it (an `interrupted` response: a cancelled stream, a usage
    limit crossed). Stored answered, such a call is never pending: it is closed, never run."""
    last = messages[-1] if messages else None
    if last is None or last.state != "interrupted":
        return []
    at = next((i for i in reversed(range(len(stored))) if stored[i].role == "assistant"), -1)
    if at < 0:
        calls, made_at = sorted(resumed), last.timestamp or utc_now()
    else:
        calls, made_at = [call.id for call in stored[at].tool_calls or ()], stored[at].created_at
    answered = {m.tool_call_id for m in stored[at + 1 :] if isinstance(m, ToolMessage)}
    return [stand_in_result(call, made_at) for call in calls if call not in answered]


def _tool_content(request: pai.ModelRequest, *, prompted: bool) -> set[int]:
    """The ids of a request's user prompt parts that hold content tools returned (a
    `ToolReturn`'s `content`): Pydantic AI puts them after the request's tool returns
    (`CallToolsNode`), alike. A run resumed with `deferred_tool_results` and a
    `user_prompt` (`prompted`: its first request) sends that prompt, the person's, last,
    after them; nothing in the parts tells it apart, so only the run can say it had one."""
    parts = list(request.parts)
    first_return = next((i for i, p in enumerate(parts) if isinstance(p, pai.ToolReturnPart)), None)
    if first_return is None:
        return set()
    prompts = [id(p) for p in parts[first_return:] if isinstance(p, pai.UserPromptPart)]
    return set(prompts[:-1] if prompted else prompts)


def _with_unique_call_ids(messages: list[AgentMessage]) -> list[AgentMessage]:
    """Rename a call id used again within the run `<id>_<n>`, as the exports do, and log it.

    Some providers number calls per response, so one run can hold `call_0`
    twice. A result answers the oldest call of its id not answered yet, which
    is the order Pydantic AI returns them in. A result answering a call of an earlier
    run (resumed after approval) takes its id too: a call the run makes later under
    that id is renamed.
    """
    used: set[str] = set()
    unanswered: dict[str, list[str]] = {}
    renamed: list[AgentMessage] = []
    for message in messages:
        if message.tool_calls:
            message = _with_calls_renamed(message, used, unanswered)
        elif message.tool_call_id and unanswered.get(message.tool_call_id):
            answered = unanswered[message.tool_call_id].pop(0)
            message = message.model_copy(update={"tool_call_id": answered})
        elif message.tool_call_id:
            used.add(message.tool_call_id)  # an earlier run's call: its id is taken
        renamed.append(message)
    return renamed


def _with_calls_renamed(
    message: AgentMessage, used: set[str], unanswered: dict[str, list[str]]
) -> AgentMessage:
    """A message's calls, each under an id not `used` yet in the run (`unique_call_id`), each
    recorded as not answered yet."""
    calls = [
        c.model_copy(update={"id": unique_call_id(c.id, used)}) for c in message.tool_calls or ()
    ]
    for original, call in zip(message.tool_calls or (), calls, strict=True):
        unanswered.setdefault(original.id, []).append(call.id)
        if call.id != original.id:
            _log.warning(
                "tool call id %r is used again within the run; stored as %r", original.id, call.id
            )
    return message.model_copy(update={"tool_calls": calls})


def _from_request_part(
    part: Any, markers: RuntimeContextMarkers, subject: str, *, from_tool: bool = False
) -> list[AgentMessage]:
    if isinstance(part, pai.SystemPromptPart):
        message = SystemMessage(content=part.content, created_at=part.timestamp)
        rebuilt = pai.SystemPromptPart(part.content, timestamp=part.timestamp)
        dumped, base = _dumped_prompt(part, subject), _dumped_prompt(rebuilt, subject)
        return [with_native(message, FORMAT, dumped, base, subject=subject)]
    if isinstance(part, pai.UserPromptPart):
        # a tool's content is stored whole: context is hidden from a person's words
        lines = _item_lines(part.content, None if from_tool else markers)
        prompt = UserMessage(
            content="\n".join(line for _, line in lines if line),
            error=tool_content_error() if from_tool else None,
            created_at=part.timestamp,
        )
        return [_with_kept(prompt, _items_kept(lines), subject)]
    if isinstance(part, pai.ToolReturnPart):
        outcome = part.outcome if part.outcome != "success" else None
        cause = part.retry.cause if part.retry is not None else None
        returned = ToolMessage(
            tool_call_id=part.tool_call_id,
            content=_tool_return_text(part),
            error=outcome_error(outcome, cause) if outcome else None,
            created_at=part.timestamp,
        )
        content = part.content if not part.files else ""  # with files: the items' text
        kinds = {"tool_kind": part.tool_kind, "ui_visibility": part.ui_visibility}
        budget = _retry_budget(part.retry)
        return [
            _with_content_kind(
                returned, content, subject, metadata=part.metadata, retry=budget, **kinds
            )
        ]
    if isinstance(part, pai.RetryFeedbackPart):
        feedback = UserMessage(
            content=_retry_text(part.content),
            error=feedback_error(part.retry.cause),
            created_at=part.timestamp,
        )
        return [
            _with_content_kind(feedback, part.content, subject, retry=_retry_budget(part.retry))
        ]
    if isinstance(part, pai.RetryPromptPart):  # deprecated; only in histories built by hand
        return [_from_retry_prompt(part, subject)]
    return []


def _from_retry_prompt(part: Any, subject: str) -> AgentMessage:
    """A deprecated retry prompt as the part it stands for: a retried return, or feedback."""
    cause = "model_retry" if isinstance(part.content, str) else "validation_error"
    message: AgentMessage
    if part.tool_name is None:
        message = UserMessage(
            content=_retry_text(part.content),
            error=feedback_error(cause),
            created_at=part.timestamp,
        )
    else:
        message = ToolMessage(
            tool_call_id=part.tool_call_id,
            content=_retry_text(part.content),
            error=outcome_error("retried", cause),
            created_at=part.timestamp,
        )
    return _with_content_kind(message, part.content, subject)


def _with_content_kind(
    message: AgentMessage,
    content: Any,
    subject: str,
    *,
    tool_kind: str | None = None,
    ui_visibility: str | None = None,
    metadata: Any = None,
    retry: dict[str, int] | None = None,
) -> AgentMessage:
    """`message` keeping in `native` what its text alone does not say of the part: whether its
    content was a `str` or a value (`_CONTENT_KIND`), the tool's kind (an output tool's
    `output`), what a UI adapter shows of it (`ui_visibility`), the `metadata` it returned
    for the application (`ToolReturn(metadata=...)`) and a retry's `attempt` and
    `max_retries` (`_RETRY_BUDGET`); the last three are never sent to the model, and kept
    as a system prompt's `metadata` is, so the history gives the part back as the run held
    it. A value whose text reads back as another (`Decimal("10.50")`'s `10.50` as 10.5,
    NaN's `null` as None) is kept as its text, which the model was sent; an empty text
    with an `error` (the run's own `ModelRetry("")`, `ToolDenied("")`) is kept too, else it
    reads as another writer's error-only result (`_reads_as_its_error`)."""
    kept: dict[str, Any] = {_CONTENT_KIND: _kind_sent(message, content)}
    if not message.content and content not in (None, ""):  # a value rendered as no text: []
        kept["content"] = runtime_json(content, subject=subject, fallback=str)
    if tool_kind is not None:
        kept["tool_kind"] = tool_kind
    if ui_visibility is not None:
        kept["ui_visibility"] = ui_visibility
    if metadata is not None:
        kept["metadata"] = runtime_json(metadata, subject=subject, fallback=str)
    if retry:
        kept[_RETRY_BUDGET] = retry
    plain_kind = "error" if _reads_as_its_error(message) else _plain_kind(message)
    return with_native(message, FORMAT, kept, {_CONTENT_KIND: plain_kind}, subject=subject)


def _retry_budget(retry: pai.RetryInfo[Any] | None) -> dict[str, int] | None:
    """A retry's `attempt` and `max_retries`, those it has (`_RETRY_BUDGET`); None for none."""
    if retry is None:
        return None
    budget = {"attempt": retry.attempt, "max_retries": retry.max_retries}
    return {key: value for key, value in budget.items() if value is not None} or None


def _with_kept(message: AgentMessage, kept: Mapping[str, Any], subject: str) -> AgentMessage:
    """`message` with `kept` added to what its own Pydantic AI form (`native`) keeps."""
    if not kept:
        return message
    own = message.native if message.native and message.native.format == FORMAT else None
    values = {**(own.set_values() if own else {}), **kept}
    values = runtime_json(values, subject=subject, fallback=str)
    form = kept_form(FORMAT, values, own.unset if own else (), subject=subject)
    return message.model_copy(update={"native": form})


def _kind_sent(message: AgentMessage, content: Any) -> str:
    """Whether the model was sent `content` as text or as a value: a value only when its
    stored text reads back as a value rendered the same (`_json_value`, `_rendered`)."""
    if isinstance(content, str):
        return "text"
    text = message.content or ""
    return "value" if not text or _rendered(_json_value(text)) == text else "text"


def _reads_as_its_error(message: AgentMessage) -> bool:
    """Whether a stored message with no `native` record replays as what its error says (a
    tool result of no text and an `error`, as another writer stores a denial)."""
    return isinstance(message, ToolMessage) and not message.content and message.error is not None


def _from_response(
    response: pai.ModelResponse, sent_at: datetime | None, subject: str
) -> AssistantMessage:
    texts = [
        p.content if isinstance(p, pai.TextPart) else f"[file {p.content.media_type}]"
        for p in response.parts
        if isinstance(p, pai.TextPart | pai.FilePart)
    ]
    calls = [
        ToolCall(
            id=p.tool_call_id,
            function=FunctionCall(name=p.tool_name, arguments=p.args_as_json_str()),
        )
        for p in response.parts
        if isinstance(p, pai.ToolCallPart)
    ]
    latency = None
    if sent_at is not None and response.timestamp >= sent_at:
        latency = whole_millis(response.timestamp - sent_at)
    return AssistantMessage(
        # A response of thinking alone still took a request and its tokens: keep it as "".
        content=_TEXTS_JOINED.join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        native=_response_form(
            texts, calls, _parts_kept(response.parts, subject), _accounting(response), subject
        ),
        token_usage=TokenUsage(
            input_tokens=response.usage.input_tokens, output_tokens=response.usage.output_tokens
        ),
        latency_ms=latency,
        created_at=response.timestamp,
    )


def _accounting(response: pai.ModelResponse) -> dict[str, Any]:
    """What `native` keeps of a response for the application, as Pydantic AI serializes it:
    its `metadata`, the fields `_ACCOUNTING` and `_IN_RUN` name that it has (its state only
    when `interrupted`: `complete` is the default, and a `suspended` response is resumed by
    its `provider_response_id`, not kept: it comes back finished), and its usage beyond the
    tokens `token_usage` holds (cache and audio tokens, `details`, a cost)."""
    fields = {key: getattr(response, key) for key in (*_ACCOUNTING, *_IN_RUN, "metadata")}
    kept = {key: value for key, value in fields.items() if value is not None}
    if kept.get("state") != "interrupted":  # `suspended` is resumed by what is not kept
        kept.pop("state", None)
    usage = _USAGE.dump_python(
        response.usage, mode="json", exclude=_IN_TOKEN_USAGE, exclude_defaults=True
    )
    return kept | {"usage": usage} if usage else kept


def _dumped_prompt(part: pai.SystemPromptPart, subject: str) -> dict[str, Any]:
    """A system prompt's fields as `native` compares them (its timestamp is `created_at`)."""
    dumped = _SYSTEM_PROMPT.dump_python(part, exclude={"timestamp"}, fallback=str)
    return dict(runtime_json(dumped, subject=subject, fallback=str))


def _parts_kept(parts: Sequence[pai.ModelResponsePart], subject: str) -> list[dict[str, Any]]:
    """A response's parts in order as `native` keeps them: one the chat fields hold as a
    stand-in naming its kind (`text`, for a file's note too, with a text's `citations`, the
    sources a UI adapter shows; `tool-call`, with the tool's
    `tool_kind` and the call's `ui_visibility` when it has them: an output tool's `output`,
    a private tool's `private`), any other whole as
    Pydantic AI serializes it (a provider's own tool call and its return, a compaction, a
    spoken reply without its audio: the store keeps no files). Thinking is left out."""
    kept: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, pai.TextPart) and part.citations:
            cited = _CITATIONS.dump_python(part.citations, mode="json", fallback=str)
            kept.append({"part_kind": "text", "citations": cited})
        elif isinstance(part, pai.TextPart | pai.FilePart):
            kept.append({"part_kind": "text"})
        elif isinstance(part, pai.ToolCallPart):
            kept.append({"part_kind": "tool-call", **_call_fields(part)})
        elif not isinstance(part, pai.ThinkingPart):
            whole = replace(part, audio=None) if isinstance(part, pai.SpeechPart) else part
            dumped = _RESPONSE_PART.dump_python(whole, fallback=str)
            kept.append(runtime_json(dumped, subject=subject, fallback=str))
    return kept


def _call_fields(part: pai.ToolCallPart) -> dict[str, str]:
    """A call's fields its stand-in keeps: the tool's kind, and what a UI adapter shows of it."""
    fields = {"tool_kind": part.tool_kind, "ui_visibility": part.ui_visibility}
    return {key: value for key, value in fields.items() if value is not None}


def _response_form(
    texts: Sequence[str],
    calls: Sequence[ToolCall],
    kept: list[dict[str, Any]],
    accounting: dict[str, Any],
    subject: str,
) -> NativeForm | None:
    """What the chat fields cannot hold of a response: its several texts apart, as OpenAI
    content parts (one `content` string cannot tell them apart: a text may hold a blank line),
    its parts' order with the parts they have no place for, unless it is theirs (its texts,
    then its calls), and what it holds for the application (`_accounting`: never sent to the
    model)."""
    difference: dict[str, Any] = dict(runtime_json(accounting, subject=subject, fallback=str))
    if len(texts) > 1:
        difference["content"] = [{"type": "text", "text": text} for text in texts]
    in_chat_order = [{"part_kind": "text"}] * len(texts) + [{"part_kind": "tool-call"}] * len(calls)
    if kept != in_chat_order:
        difference["parts"] = kept
    return kept_form(FORMAT, difference, subject=subject) if difference else None


def _kept(message: AgentMessage, key: str) -> Any:
    """What a message's own Pydantic AI form (`native`) holds under `key`, as it was given."""
    native = message.native
    return native.set_values().get(key) if native is not None and native.format == FORMAT else None


def _text_parts(message: AssistantMessage) -> list[str]:
    """The texts of a response stored as `message`: its kept text parts, or its one text (also
    when what `native` holds is not a list of text parts: someone else's form)."""
    kept = _kept(message, "content")
    if isinstance(kept, list) and kept:
        texts = [part.get("text") if isinstance(part, dict) else None for part in kept]
        if all(isinstance(text, str) for text in texts):
            return [str(text) for text in texts]
    return [message.content] if message.content else []


def _items_text(content: str | Sequence[Any], markers: RuntimeContextMarkers | None) -> str:
    """Content items as stored text, one line each (`_item_lines`), an empty one left out."""
    return "\n".join(line for _, line in _item_lines(content, markers) if line)


def _item_lines(
    content: str | Sequence[Any], markers: RuntimeContextMarkers | None
) -> list[tuple[Any, str]]:
    """Each content item with its stored line: a text item as the model is sent it (a
    `TextContent`'s, a `StructuredContent`'s `content`), any other item a `[kind]` note, a
    `CachePoint` (a cache boundary, nothing sent) nothing. With `markers`, hidden context is
    removed from the text items read as one text, so a block cut across items goes too."""
    if isinstance(content, str):
        return [(content, content if markers is None else strip_runtime_context(content, markers))]
    items = [item for item in content if not isinstance(item, pai.CachePoint)]
    sent = [_sent_text(item) for item in items]
    texts = [text for text in sent if text is not None]
    visible = iter(texts if markers is None else strip_runtime_context_pieces(texts, markers))
    notes = (f"[{getattr(item, 'kind', type(item).__name__)}]" for item in items)
    return [
        (item, next(visible) if text is not None else note)
        for item, text, note in zip(items, sent, notes, strict=True)
    ]


def _items_kept(lines: Sequence[tuple[Any, str]]) -> dict[str, Any]:
    """What `native` keeps of a prompt's items: when a text item holds `metadata` for the
    application (never sent to the model), each stored line apart as an OpenAI content part,
    a `TextContent`'s with its `metadata`, so the history gives the items back with it."""
    tags = [item.metadata if isinstance(item, pai.TextContent) else None for item, _ in lines]
    if all(tag is None for tag in tags):
        return {}
    return {
        "items": [
            {"type": "text", "text": line, **({"metadata": tag} if tag is not None else {})}
            for (_, line), tag in zip(lines, tags, strict=True)
            if line or tag is not None
        ]
    }


def _sent_text(item: Any) -> str | None:
    """The text the model is sent of a content item, or None for a file."""
    if isinstance(item, str):
        return item
    return item.content if isinstance(item, pai.TextContent) else None


def _tool_return_text(part: pai.ToolReturnPart) -> str:
    """A tool's result as stored text: the JSON text the model is sent; with files, its items
    in order as `_items_text` stores a prompt's, each file a `[kind]` note."""
    if not part.files:
        return part.model_response_str(wrap_if_error=False)
    return _items_text(part.content_items(mode="str", wrap_if_error=False), None)


def _retry_text(content: str | Sequence[Any]) -> str:
    if isinstance(content, str):
        return content
    return _compact_json(list(content))


def _compact_json(value: Any) -> str:
    """JSON as Pydantic AI renders a value for the model: compact, unescaped UTF-8."""
    return pydantic_core.to_json(value, fallback=str).decode()


# -- stored messages into a history ---------------------------------------------------


def history_from_messages(
    stored: Sequence[AgentMessage | Mapping[str, Any]],
) -> list[pai.ModelMessage]:
    """The Pydantic AI history of a stored conversation, to pass as `message_history`.

    Messages the model never produced or received are left out: an assistant
    message carrying only an `error`, and the text of a HITL prompt (the
    runtime's question; its calls stay). Assistant messages with nothing but
    assistant messages between them are one response, as the model gave it (a
    stream stores a call or text after a prompt in a new message): its parts in
    stored order. Each call is answered right after its response by the result stored
    for it, wherever it was stored (a real result wins over an `interrupted` stand-in); a
    tool message answering no earlier call is left out. A call of the last response with
    no stored result is left open, whatever user or system messages follow it (the person
    wrote while the run was paused), as `pending_calls` lists it: a run given
    `deferred_tool_results` resumes it from this history alone, Pydantic AI sending those
    messages after the call's results. Messages said after a pause's results (those of the
    response's other calls) are a request of their own after theirs, which keeps Pydantic
    AI's mark of the pause (its `metadata`): a run given the history without the results
    answers them, where a pause marked over them would pause it again. A call a later
    response went past is answered by the stand-in every replay gives a call still awaiting
    approval or its result (`PENDING_RESULT`, failed), never stored: its real result, logged
    later, takes its place.
    """
    messages = as_messages(stored)
    answers = answers_to_calls(messages)
    history: list[pai.ModelMessage] = []
    parts: list[Any] = []
    said: list[AgentMessage] = []
    """The user and system messages since the last response, sent in the next request."""
    answering: list[tuple[int, AssistantMessage]] = []
    """The messages of the last response, whose calls the next request answers."""

    def flush_request(*, at_end: bool = False) -> None:
        returns = _returns(answering, answers, leave_open=at_end)
        history.extend(_requests(returns, _answers_of(answering, answers), parts, said))
        answering.clear()
        parts.clear()
        said.clear()

    for item in _responses_gathered(messages):
        if isinstance(item, list):
            flush_request()
            history.append(_to_response([message for _, message in item]))
            answering.extend(item)
        elif isinstance(item, SystemMessage):
            parts.append(_to_system_part(item))
            said.append(item)
        elif isinstance(item, UserMessage):
            parts.append(_to_user_part(item))
            said.append(item)
        # A tool message is placed with the call it answers, by `_returns`.
    flush_request(at_end=True)
    return history


def _requests(
    returns: Sequence[pai.ToolReturnPart],
    answered: Sequence[ToolMessage],
    parts: Sequence[Any],
    said: Sequence[AgentMessage],
) -> list[pai.ModelRequest]:
    """The request after a response: its calls' `returns` (of the results `answered`), then
    the `parts` of the user and system messages `said` since; two requests when those were
    said after a pause (`_sent_apart`), each keeping what its first stored message keeps of
    it."""
    requests: list[tuple[list[Any], list[AgentMessage]]] = [
        ([*returns, *parts], [*answered, *said])
    ]
    if _sent_apart(answered, said):
        requests = [(list(returns), list(answered)), (list(parts), list(said))]
    return [
        pai.ModelRequest(parts=body, timestamp=body[0].timestamp, **_request_kept(sent))
        for body, sent in requests
        if body
    ]


def _sent_apart(answered: Sequence[ToolMessage], said: Sequence[AgentMessage]) -> bool:
    """Whether the user or system messages `said` after a response's stored results go in a
    request of their own: when the results' request is the record of a pause (Pydantic AI
    marks it in its `metadata`, `_PAUSE_MARK`), which holds the results a run gave as it
    paused and nothing else: what was said after them (the person wrote while the run was
    paused) under that mark would read as the pause still standing."""
    metadata = _request_kept(answered)["metadata"] if said else None
    mark = metadata.get(_PAUSE_MARK[0]) if isinstance(metadata, Mapping) else None
    return isinstance(mark, Mapping) and mark.get(_PAUSE_MARK[1]) is True


_PAUSE_MARK = ("__pydantic_ai__", "deferred_pause")
"""Where Pydantic AI marks the request a run wrote as it paused for deferred calls, in the
request's `metadata` (its namespace, then its key: its `_is_deferred_pause_record`)."""


def _request_kept(sent: Sequence[AgentMessage]) -> dict[str, Any]:
    """What the first of a request's stored messages keeps of it in `native`: its `metadata`
    and its `conversation_id`, each None when none keeps it."""
    return {
        "metadata": _first_kept(sent, _REQUEST_METADATA),
        "conversation_id": _first_kept(sent, _CONVERSATION_ID, str),
    }


def _responses_gathered(
    messages: Sequence[AgentMessage],
) -> list[AgentMessage | list[tuple[int, AssistantMessage]]]:
    """The messages, each run of assistant messages the model said as one response gathered
    into a list of them (with their indexes), nothing else between them: a stream stores a
    call or text coming after a HITL prompt in a new assistant message. One it never said
    (an `error` alone, a prompt holding no call) is left out."""
    items: list[AgentMessage | list[tuple[int, AssistantMessage]]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, AssistantMessage):
            items.append(message)
        elif _said_by_model(message):
            if items and isinstance(items[-1], list):
                items[-1].append((index, message))
            else:
                items.append([(index, message)])
    return items


def _returns(
    responses: Sequence[tuple[int, AssistantMessage]],
    answers: Mapping[CallKey, ToolMessage],
    *,
    leave_open: bool,
) -> list[pai.ToolReturnPart]:
    """The returns of a response's calls, in call order; an unanswered one, unless left open,
    as the stand-in every replay gives a call still awaiting approval or its result that the
    conversation went on after (`pending_stand_in`: `PENDING_RESULT`, failed), never stored."""
    returns = []
    for index, message in responses:
        for call in message.tool_calls or ():
            answer = answers.get((index, call.id))
            if answer is None and not leave_open:
                answer = pending_stand_in(call.id, message.created_at)
            if answer is not None:
                returns.append(_to_tool_return(answer, call.function.name))
    return returns


def _answers_of(
    responses: Sequence[tuple[int, AssistantMessage]], answers: Mapping[CallKey, ToolMessage]
) -> list[ToolMessage]:
    """The stored results of a response's calls, in call order."""
    return [
        answer
        for index, message in responses
        for call in message.tool_calls or ()
        if (answer := answers.get((index, call.id))) is not None
    ]


def _said_by_model(message: AssistantMessage) -> bool:
    """Whether the message holds something the model said: text (an empty one, of a response
    that only thought, too) or calls. A HITL prompt's text is the runtime's question."""
    return message.tool_calls is not None or (
        message.hitl_action is None and message.content is not None
    )


def _to_response(messages: Sequence[AssistantMessage]) -> pai.ModelResponse:
    """One response of the messages it was stored as, its parts in stored order."""
    # A HITL prompt's text is the runtime's question, not the model's: replayed as a response
    # it would end the run before the call it holds, which then could never be resumed.
    response_parts: list[pai.ModelResponsePart] = []
    usage = RequestUsage()
    for message in messages:
        texts = _text_parts(message) if message.hitl_action is None else []
        calls = [
            pai.ToolCallPart(
                call.function.name, _arguments(call.function.arguments), tool_call_id=call.id
            )
            for call in message.tool_calls or ()
        ]
        response_parts.extend(_in_kept_order(message, [*map(pai.TextPart, texts)], calls))
        usage = usage + _usage_of(message)
    return replace(
        _accounting_of(messages),
        parts=response_parts,
        usage=usage,
        timestamp=messages[0].created_at,
        metadata=_first_kept(messages, "metadata"),
    )


def _usage_of(message: AssistantMessage) -> RequestUsage:
    """A stored response's usage: the tokens `token_usage` holds, with the rest `native`
    keeps (`_accounting`); only those tokens when it keeps none, or keeps no usage of
    Pydantic AI's (someone else's form)."""
    counted = message.token_usage or TokenUsage()
    usage = RequestUsage(input_tokens=counted.input_tokens, output_tokens=counted.output_tokens)
    kept = _kept(message, "usage")
    if not isinstance(kept, dict) or kept.keys() & _IN_TOKEN_USAGE:
        return usage
    try:
        return _USAGE.validate_python({**kept, **counted.model_dump()})
    except ValidationError:
        return usage


def _accounting_of(messages: Sequence[AssistantMessage]) -> pai.ModelResponse:
    """An empty response with the model, provider and finish reason (`_ACCOUNTING`), its state
    and conversation (`_IN_RUN`) kept by the first of `messages` that keeps any; with none
    when they are not Pydantic AI's."""
    for message in messages:
        kept = {key: _kept(message, key) for key in (*_ACCOUNTING, *_IN_RUN)}
        kept = {key: value for key, value in kept.items() if value is not None}
        if kept:
            try:
                return _RESPONSE.validate_python({"parts": [], **kept})
            except ValidationError:
                break
    return pai.ModelResponse(parts=[])


def _first_kept(messages: Iterable[AgentMessage], key: str, kind: type[Any] = dict) -> Any:
    """The first value of `kind` the messages' own Pydantic AI forms keep under `key` (a
    response's or a request's `metadata`, a request's `conversation_id`), or None."""
    return next((kept for m in messages if isinstance(kept := _kept(m, key), kind)), None)


def _in_kept_order(
    message: AssistantMessage, texts: list[pai.TextPart], calls: list[pai.ToolCallPart]
) -> list[pai.ModelResponsePart]:
    """A stored response's parts in the order `native` keeps: each stand-in the next text or
    call of the chat fields, each other part whole; what the chat fields hold beyond the
    stand-ins after them. With no kept order, or one that is not Pydantic AI's parts (someone
    else's form): its texts, then its calls."""
    kept = _kept_order(message)
    if kept is None:
        return [*texts, *calls]
    in_chat: dict[str, Iterator[pai.ModelResponsePart]] = {
        "text": iter(texts),
        "tool-call": iter(calls),
    }
    parts: list[pai.ModelResponsePart] = []
    for entry in kept:
        if not isinstance(entry, tuple):
            parts.append(entry)
        elif (taken := next(in_chat[entry[0]], None)) is not None:
            parts.append(_with_stand_in_fields(taken, entry[1]))
    return [*parts, *in_chat["text"], *in_chat["tool-call"]]


def _with_stand_in_fields(
    part: pai.ModelResponsePart, fields: dict[str, Any]
) -> pai.ModelResponsePart:
    """A text or call the chat fields hold, with the fields its stand-in keeps: a text's
    `citations`; a call's (`_call_fields`) the tool's kind (an output tool's `output`), as
    Pydantic AI types a part of that kind, and what a UI adapter shows of it
    (`ui_visibility`)."""
    if not fields:
        return part
    if isinstance(part, pai.TextPart):
        try:
            return replace(part, citations=_CITATIONS.validate_python(fields.get("citations")))
        except ValidationError:
            return part
    if not isinstance(part, pai.ToolCallPart):
        return part
    call = replace(
        cast(pai.ToolCallPart, part),
        tool_kind=fields.get("tool_kind"),
        ui_visibility=_ui_visibility(fields.get("ui_visibility")),
    )
    return call if call.tool_kind is None else pai.ToolCallPart.narrow_type(call)


_StandIn = tuple[str, dict[str, Any]]
"""A part the chat fields hold, in a response's kept order: its kind, and the fields its
stand-in keeps (a call's `_call_fields`, a text's `citations`)."""
_STAND_IN_FIELDS = {"tool-call": {"tool_kind", "ui_visibility"}, "text": {"citations"}}


def _kept_order(message: AssistantMessage) -> list[pai.ModelResponsePart | _StandIn] | None:
    """The parts `native` keeps of a response, a stand-in as the kind it stands for (and a
    call's and a text's with the fields it keeps)."""
    kept = _kept(message, "parts")
    if not isinstance(kept, list):
        return None
    order: list[pai.ModelResponsePart | _StandIn] = []
    for entry in kept:
        if isinstance(entry, dict) and entry.keys() == {"part_kind"}:
            if entry["part_kind"] not in _IN_CHAT_FIELDS:
                return None
            order.append((entry["part_kind"], {}))
            continue
        kind = entry.get("part_kind") if isinstance(entry, dict) else None
        if isinstance(kind, str) and kind in _STAND_IN_FIELDS:
            fields = {key: value for key, value in entry.items() if key != "part_kind"}
            if fields.keys() <= _STAND_IN_FIELDS[kind]:
                if kind == "tool-call" and not all(isinstance(v, str) for v in fields.values()):
                    return None
                order.append((kind, fields))
                continue
        try:
            order.append(_RESPONSE_PART.validate_python(entry))
        except ValidationError:
            return None
    return order


def _to_system_part(message: SystemMessage) -> pai.SystemPromptPart:
    """A system prompt with the fields `native` keeps (a dynamic prompt's `dynamic_ref`, so
    Pydantic AI evaluates it again on the next run), or only its text when they are not a
    system prompt's fields."""
    rebuilt = pai.SystemPromptPart(message.content or "", timestamp=message.created_at)
    form = native_form(FORMAT, message, _dumped_prompt(rebuilt, f"stored message {message.id}"))
    try:
        prompt = _SYSTEM_PROMPT.validate_python(form)
    except ValidationError:
        return rebuilt
    return replace(prompt, timestamp=rebuilt.timestamp)


def _to_tool_return(message: ToolMessage, tool_name: str) -> pai.ToolReturnPart:
    """The return a tool message stands for: its content as the run held it
    (`_content_of`, the stored text when the bridge recorded its kind, an empty one too);
    one stored with no text and an `error` by another writer (no record) as what its error
    says, as every other reader replays it (`result_text`); its tool's kind, what a UI
    adapter shows of it and the `metadata` it returned for the application kept."""
    assert message.tool_call_id is not None
    marked = tool_outcome(message)
    outcome, cause = marked if marked is not None else (None, None)
    retry_cause = _TOOL_RETRY_CAUSES.get(cause or "", "model_retry")
    tool_kind = _kept(message, "tool_kind")
    own = _kept(message, _CONTENT_KIND) in ("text", "value")  # the bridge's own record
    returned = pai.ToolReturnPart(
        tool_name,
        _content_of(message, (message.content or "") if own else result_text(message)),
        tool_call_id=message.tool_call_id,
        timestamp=message.created_at,
        outcome=outcome or "success",
        retry=pai.RetryInfo(retry_cause, **_retry_budget_of(message))
        if outcome == "retried"
        else None,
        metadata=_kept(message, "metadata"),
        ui_visibility=_ui_visibility(_kept(message, "ui_visibility")),
    )
    if not isinstance(tool_kind, str):
        return returned
    return pai.ToolReturnPart.narrow_type(replace(returned, tool_kind=tool_kind))


def _retry_budget_of(message: ToolMessage | UserMessage) -> dict[str, int]:
    """A retry's `attempt` and `max_retries` as `native` keeps them (`_RETRY_BUDGET`), those
    that are whole numbers; none when it keeps none (someone else's form, an older message)."""
    kept = _kept(message, _RETRY_BUDGET)
    if not isinstance(kept, dict):
        return {}
    return {
        key: value
        for key in ("attempt", "max_retries")
        if isinstance(value := kept.get(key), int) and not isinstance(value, bool)
    }


def _ui_visibility(kept: Any) -> pai.ToolUIVisibility | None:
    """A kept `ui_visibility`, or None when it is none Pydantic AI knows."""
    return _UI_VISIBILITIES.get(kept) if isinstance(kept, str) else None


def _to_user_part(message: UserMessage) -> Any:
    is_feedback, cause = feedback_cause(message)
    if is_feedback:
        return pai.RetryFeedbackPart(
            _content_of(message, message.content or ""),
            retry=pai.RetryInfo(
                _FEEDBACK_CAUSES.get(cause or "", "model_retry"), **_retry_budget_of(message)
            ),
            timestamp=message.created_at,
        )
    text = prompt_text(message) or ""
    return pai.UserPromptPart(_prompt_items(message, text) or text, timestamp=message.created_at)


def _prompt_items(message: UserMessage, text: str) -> list[str | pai.TextContent] | None:
    """A prompt's items as `native` keeps them (`_items_kept`): a text with its `metadata` a
    `TextContent`, any other a `str` of its stored line; None when it keeps none, or keeps
    items that are not the stored text's lines (someone else's form)."""
    kept = _kept(message, "items")
    if not isinstance(kept, list) or not all(isinstance(i, dict) for i in kept):
        return None
    lines = [item.get("text") for item in kept]
    if not all(isinstance(line, str) for line in lines):
        return None
    if "\n".join(str(line) for line in lines if line) != text:
        return None
    return [
        pai.TextContent(str(item["text"]), metadata=item["metadata"])
        if "metadata" in item
        else str(item["text"])
        for item in kept
    ]


def _arguments(text: str) -> Any:
    """A call's stored arguments back as the object they are the compact JSON of, else as
    the text (Pydantic AI sends either as the same text): the text too for an object nested
    deeper than the store walks JSON (`MAX_PARAMS_DEPTH`), which Pydantic AI could not
    serialize back (past about 130 levels)."""
    value = _json_value(text)
    if not isinstance(value, dict) or nests_deeper_than(value, MAX_PARAMS_DEPTH):
        return text
    return value if _compact_json(value) == text else text


def _content_of(message: ToolMessage | UserMessage, text: str) -> Any:
    """A tool result's or retry feedback's content as the run held it: `text` for a `str`,
    the value `text` is the JSON of for a value, as `native` records (`_CONTENT_KIND`); with
    no record (an older message, another writer's), as `_plain_kind` reads the text. A retry's
    value is only ever a validation error's details: anything else is its text."""
    kind = _kept(message, _CONTENT_KIND)
    if kind not in ("text", "value"):
        kind = _plain_kind(message)
    if kind == "text":
        return text
    value = _json_value(text) if text else _kept(message, "content")
    return text if _retry_cause(message) is not None and not _error_details(value) else value


def _plain_kind(message: AgentMessage) -> str:
    """What a tool result's or retry feedback's stored text alone reads as: a value when it
    is a non-empty object or list Pydantic AI renders to the very same text (an empty one, a
    `str` holding JSON, renders otherwise), and a retry's only when it is a validation
    error's details (a `ModelRetry` message is a `str`, whatever it holds); else text."""
    text = message.content or ""
    value = _json_value(text) if text.startswith(("{", "[")) else None
    cause = _retry_cause(message)
    if cause is None:
        fits = isinstance(value, dict | list) and bool(value)
    else:
        fits = cause == "validation_error" and _error_details(value)
    return "value" if fits and _rendered(value) == text else "text"


def _retry_cause(message: AgentMessage) -> str | None:
    """The cause of a retried return or of retry feedback ("" when it names none), or None
    for any other message."""
    if isinstance(message, ToolMessage):
        marked = tool_outcome(message)
        return (marked[1] or "") if marked is not None and marked[0] == "retried" else None
    if isinstance(message, UserMessage):
        is_feedback, cause = feedback_cause(message)
        return (cause or "") if is_feedback else None
    return None


def _error_details(value: Any) -> bool:
    """Whether `value` is a validation error's details, as a retry holds them: a list of
    objects."""
    return isinstance(value, list) and bool(value) and all(isinstance(e, dict) for e in value)


def _json_value(text: str) -> Any:
    """The value `text` is the JSON of; None for no text (Pydantic AI renders None as no
    text); `text` itself when it is no JSON."""
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # no JSON, or nested deeper than Python reads
        return text


def _rendered(value: Any) -> str:
    """The text Pydantic AI gives the model of a tool's result `value` (a retry's too)."""
    return pai.ToolReturnPart("", value).model_response_str(wrap_if_error=False)


# -- logging --------------------------------------------------------------------------


class _Unsaid(Enum):
    """`log_run`'s `user_prompt` when the runtime does not say what the run was given."""

    PROMPT = "not said"


async def log_run(
    logger: AgentMessageLogger,
    conversation_id: str,
    messages: Sequence[pai.ModelMessage],
    *,
    turn_id: str,
    user_id: str | None = None,
    name: str | None = None,
    deferred_tool_results: DeferredToolResults | None = None,
    user_prompt: str | Sequence[pai.UserContent] | _Unsaid | None = _Unsaid.PROMPT,
) -> LoggedTurn:
    """Store an agent run's new messages as one turn (idempotent by `turn_id`).

    Hidden runtime context is stripped from the person's prompts by the logger's
    rules' markers, so only what the user saw is stored (a tool's content and retry
    feedback are stored whole, as the model was sent them). A run resumed with
    `deferred_tool_results` answers calls of an earlier run: it names them
    (`AgentMessageLogger.calls_answered`, one read more, only then), so when another run
    answered one of them first (two tabs resuming one paused run) it is refused
    (`AnsweredBefore`), nothing stored; its retry is still a replay. A denial of a call whose
    first answer was a denial too (the person denied it over HTTP after the runtime read the
    history) answers nothing new: it is dropped, and the run is stored without it, the
    results of the tools that ran included (`_answering.log_answering`); the turn returned
    holds no message for that call. Each result names its
    tool (`ToolReturnPart.tool_name`) and answers the latest call of its id of that tool; one
    whose id only another tool's calls use (a provider numbering calls per response, the
    conversation deleted and started again since) is refused InvalidInput, nothing stored.
    Pass the run's
    `deferred_tool_results`: a resumed run cut off while the approved tools ran holds no
    response of its own, and its messages alone do not say which calls it resumed; given
    them, it closes those that returned nothing (`interrupted`), as Pydantic AI does. Pass
    its `user_prompt` too, as the run was given it (None for none): Pydantic AI sends a
    resumed run's prompt after its tools' content, both as user prompts, and only the run
    can say which is the person's; not said, the last of them is taken for it.

    With `user_id`, the run is logged by a runtime acting for that user (`strict_owner`):
    into their own conversation, or a new id created as theirs; any other (a service's
    unowned one, another user's, another user's legacy turns) is NotFound, as to the user's
    token, nothing stored. The turn stays a runtime's: it may open its steering inbox.
    """
    resumed = _resumed_calls(deferred_tool_results)
    stored = messages_from_run(
        messages, markers=logger.rules.markers, resumed=resumed, prompted=user_prompt is not None
    )
    return await log_answering(
        logger,
        conversation_id,
        stored,
        turn_id=turn_id,
        user_id=user_id,
        name=name,
        tool_names=_tools_returned(messages),
    )


def _tools_returned(messages: Sequence[pai.ModelMessage]) -> dict[str, str]:
    """The tool each result the run returns for a call of an earlier run is of (call id to
    `tool_name`, of a `ToolReturnPart` or a tool's `RetryPromptPart` whose id no call of the
    run made before it): `calls_answered` refuses one naming another tool than the call of
    its id (the provider used the id again, in another run or an earlier life of the
    conversation). Such a result keeps its id in the stored messages, a later call of the
    run using it again being renamed (`_with_unique_call_ids`)."""
    made: set[str] = set()
    tools: dict[str, str] = {}
    for message in messages:
        for part in message.parts:
            if isinstance(part, pai.ToolCallPart):
                made.add(part.tool_call_id)
            if not isinstance(part, pai.ToolReturnPart | pai.RetryPromptPart):
                continue
            if part.tool_name and part.tool_call_id not in made:
                tools.setdefault(part.tool_call_id, part.tool_name)
    return tools


def _resumed_calls(results: DeferredToolResults | None) -> list[str]:
    """The ids of the calls a run's `deferred_tool_results` resumed it on."""
    return [] if results is None else [*results.approvals, *results.calls]
