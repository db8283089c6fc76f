"""Turns of every shape a runtime logs: the messages the dual-write copy and the migration's
gate must carry over whole and in order, shared by the tests of both."""

from __future__ import annotations

from typing import Any

_CALL = {"id": "call-1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
NATIVE_FORM = {"format": "openai-agents", "set": {"type": "reasoning", "summary": ["«REASONING»"]}}
_PROMPT = {"action": "approve", "params": {"amount": 5}, "request_id": "r1"}
_UPLOAD = {"filename": "f.txt", "file_type": "text/plain", "size": 4, "parsed_text": "abcd"}
TURN_SHAPES: dict[str, list[dict[str, Any]]] = {
    "text and a call in one message": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "rain"},
        {"role": "assistant", "content": "It rains."}],
    "two user messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "two"}],
    "a system message mid-turn": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "one"},
        {"role": "system", "content": "be brief"}, {"role": "assistant", "content": "two"}],
    "a system prompt first": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}],
    "a prompt holding its calls": [
        {"role": "user", "content": "pay"},
        {"role": "assistant", "content": "Pay?", "tool_calls": [_CALL],
         "hitl_action": _PROMPT | {"tool_call_ids": ["call-1"]}}],
    "a prompt after its calls": [
        {"role": "user", "content": "pay"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "assistant", "content": "Pay?", "hitl_action": _PROMPT}],
    "a result without content": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": None},
        {"role": "assistant", "content": "ok"}],
    "an error beside a text": [
        {"role": "user", "content": "sum up"},
        {"role": "assistant", "content": "«PARTIAL»", "error": {"message": "cut"}}],
    "uploads on two user messages": [
        {"role": "user", "content": "see", "upload": _UPLOAD},
        {"role": "user", "content": None, "upload": _UPLOAD | {"filename": "g.txt"}},
        {"role": "assistant", "content": "ok"}],
    "an assistant first": [{"role": "assistant", "content": "How can I help?"}],
}  # fmt: skip

NATIVE_SHAPE: list[dict[str, Any]] = [
    {"role": "user", "content": "sum up"},
    {"role": "assistant", "content": "«PARTIAL»", "error": {"message": "cut"}},
    {"role": "assistant", "content": None, "native": {
        "format": "openai-agents", "set": {"type": "reasoning", "summary": ["«NATIVE»"]}}},
    {"role": "assistant", "content": "Done."}]  # fmt: skip
"""A text beside an error, then a runtime's own item (a reasoning item) no legacy part holds."""
