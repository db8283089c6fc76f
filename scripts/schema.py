"""`python -m scripts.schema`: write the JSON Schema of the stored documents into `schemas/`.

A test checks they are current; `scripts/typescript.py` derives the TypeScript types the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from agent_store.core import AgentMessage, Conversation, ConversationPage, MessagePage

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

SCHEMAS: dict[str, TypeAdapter[Any]] = {
    "agent-message.schema.json": TypeAdapter(AgentMessage),
    "agent-conversation.schema.json": TypeAdapter(Conversation),
    "message-page.schema.json": TypeAdapter(MessagePage),
    "conversation-page.schema.json": TypeAdapter(ConversationPage),
}


def render() -> dict[str, str]:
    """File name → JSON text of every schema, as the models define them now."""
    return {
        name: json.dumps(adapter.json_schema(mode="serialization"), indent=2, sort_keys=True) + "\n"
        for name, adapter in SCHEMAS.items()
    }


def main() -> int:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, text in render().items():
        (SCHEMA_DIR / name).write_text(text)
        print(f"wrote schemas/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
