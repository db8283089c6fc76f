"""Legacy turn documents: the one reader of their format, the converter, the dual write and
the read fallback. Built on the store; the store never imports it."""

from agent_store.legacy._convert import LegacyConversion, Problem, convert
from agent_store.legacy._documents import (
    LEGACY_TURN_FIELDS,
    LEGACY_TURNS,
    SESSION_HITL,
    LegacyTurn,
    TurnTime,
    as_count,
    as_text,
    dated_turns,
    derived_conversation_id,
    dumps,
    group_conversations,
    id_text,
    parse_turns,
    sort_turns,
    turn_times,
)
from agent_store.legacy._dual_write import (
    legacy_turn_document,
    legacy_turn_documents,
    legacy_turn_id,
)
from agent_store.legacy._parts import (
    LegacyPart,
    PartKind,
    call_arguments,
    error_text,
    normalize_part,
    part_kind,
    part_text,
    result_text,
    turn_parts,
    user_text,
)
from agent_store.legacy._session_hitl import pending_from_session_hitl, with_session_prompts
from agent_store.legacy._source import LegacyTurns

__all__ = [
    "LEGACY_TURNS",
    "LEGACY_TURN_FIELDS",
    "SESSION_HITL",
    "LegacyConversion",
    "LegacyPart",
    "LegacyTurn",
    "LegacyTurns",
    "PartKind",
    "Problem",
    "TurnTime",
    "as_count",
    "as_text",
    "call_arguments",
    "convert",
    "dated_turns",
    "derived_conversation_id",
    "dumps",
    "error_text",
    "group_conversations",
    "id_text",
    "legacy_turn_document",
    "legacy_turn_documents",
    "legacy_turn_id",
    "normalize_part",
    "parse_turns",
    "part_kind",
    "part_text",
    "pending_from_session_hitl",
    "result_text",
    "sort_turns",
    "turn_parts",
    "turn_times",
    "user_text",
    "with_session_prompts",
]
