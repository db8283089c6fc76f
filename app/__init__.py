"""Agent conversation store: one MongoDB document per message, in the OpenAI chat format."""

from app.conversations import ConversationStore
from app.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    StorageFailure,
    StorageUnavailable,
    StoreError,
    Unsupported,
)
from app.logger import AgentMessageLogger, LoggedTurn
from app.models import (
    AgentMessage,
    AssistantMessage,
    Conversation,
    SystemMessage,
    ToolMessage,
    UserMessage,
)
from app.turns import TurnRules

__all__ = [
    "AgentMessage",
    "AgentMessageLogger",
    "AssistantMessage",
    "Conflict",
    "Conversation",
    "ConversationStore",
    "InvalidInput",
    "LoggedTurn",
    "NotFound",
    "StorageFailure",
    "StorageUnavailable",
    "StoreError",
    "SystemMessage",
    "ToolMessage",
    "TurnRules",
    "Unsupported",
    "UserMessage",
]
