"""`python -m scripts.schema`: write the JSON Schemas of the wire contract into `schemas/`.

- `schemas/api/`: one file per API response (the served form), e.g.
  `transcript.schema.json`, `agent-conversation.schema.json`.
- `schemas/stored/`: the documents of `agent_messages` and `agent_conversations`
  in canonical Extended JSON, which keeps the BSON types.

Both come from scripts/contract.py, as the TypeScript declarations do; a test
checks the files are current.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scripts.contract import MESSAGE, file_stem, served, standalone, stored

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"

TITLES = {MESSAGE: "A message, any role", "Conversation": "A conversation"}


def _text(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def render() -> dict[str, str]:
    """Path under `schemas/` → JSON text of every schema, as the models define them now."""
    roots, definitions = served()
    files = {
        f"api/{file_stem(name)}.schema.json": _text(
            standalone(root, definitions, TITLES.get(name, name))
        )
        for name, root in roots.items()
    }
    files |= {
        f"stored/{file_stem(name)}.schema.json": _text(schema) for name, schema in stored().items()
    }
    return files


def main() -> int:
    rendered = render()
    for old in SCHEMA_DIR.glob("**/*.schema.json"):
        if str(old.relative_to(SCHEMA_DIR)) not in rendered:
            old.unlink()
            print(f"removed schemas/{old.relative_to(SCHEMA_DIR)}")
    for name, text in rendered.items():
        path = SCHEMA_DIR / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote schemas/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
