"""The store: the write path, the read path, the collections and their indexes, the text rules.

It imports only `agent_store.core` and the driver. Legacy turns and the dual
write reach it through the protocols in `LegacySource` and `TurnObserver`.
"""

from agent_store.store._driver import DUPLICATE_KEY, Database, redact_uri, storage_errors
from agent_store.store._indexes import (
    CONVERSATIONS,
    INDEXES,
    MESSAGES,
    IndexSetup,
    create_indexes,
    create_indexes_sync,
)
from agent_store.store._legacy_seam import FallbackConversation, LegacySource
from agent_store.store._logger import AgentMessageLogger, LoggedTurn, TurnObserver
from agent_store.store._reads import (
    MAX_PAGE_SIZE,
    MAX_SEARCH_QUERY_CHARS,
    Claimed,
    ConversationExport,
    ConversationStore,
    Deleted,
    SearchHit,
    SortOrder,
)
from agent_store.store._text import (
    DEFAULT_MARKERS,
    ELLIPSIS,
    MAX_NAME_CHARS,
    RuntimeContextMarkers,
    auto_name,
    clean_name,
    collapse_whitespace,
    message_text,
    search_text,
    shorten,
    strip_runtime_context,
)
from agent_store.store._truncation import DEFAULT_MAX_MESSAGE_BYTES, bound_message, document_size
from agent_store.store._turns import (
    MAX_MESSAGES_PER_TURN,
    KeepPendingHitl,
    TurnPlan,
    TurnRules,
    derive_turn_id,
    message_id,
    parse_messages,
    plan_turn,
    validate_identifier,
)

__all__ = [
    "CONVERSATIONS",
    "DEFAULT_MARKERS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DUPLICATE_KEY",
    "ELLIPSIS",
    "INDEXES",
    "MAX_MESSAGES_PER_TURN",
    "MAX_NAME_CHARS",
    "MAX_PAGE_SIZE",
    "MAX_SEARCH_QUERY_CHARS",
    "MESSAGES",
    "AgentMessageLogger",
    "Claimed",
    "ConversationExport",
    "ConversationStore",
    "Database",
    "Deleted",
    "FallbackConversation",
    "IndexSetup",
    "KeepPendingHitl",
    "LegacySource",
    "LoggedTurn",
    "RuntimeContextMarkers",
    "SearchHit",
    "SortOrder",
    "TurnObserver",
    "TurnPlan",
    "TurnRules",
    "auto_name",
    "bound_message",
    "clean_name",
    "collapse_whitespace",
    "create_indexes",
    "create_indexes_sync",
    "derive_turn_id",
    "document_size",
    "message_id",
    "message_text",
    "parse_messages",
    "plan_turn",
    "redact_uri",
    "search_text",
    "shorten",
    "storage_errors",
    "strip_runtime_context",
    "validate_identifier",
]
