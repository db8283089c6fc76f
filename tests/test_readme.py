"""Every code block of the README runs: a newcomer's page must not lie.

- The library block runs as pasted, as a script, against the embedded server.
- The runtime blocks run inside an async function, as the README says, with `db` a fresh
  database and `model` a fake of the runtime's kind (no network).
- The curl block runs in bash against `python -m app` (the shared running app of
  tests/test_run.py), with `TOKEN` and `BASE` set as the README tells the reader to.
- A block of `make` commands names only targets the Makefile has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.test_run import Running, running  # noqa: F401 (the shared running app)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def blocks(language: str, containing: str = "") -> list[str]:
    return [code for lang, code in BLOCKS if lang == language and containing in code]


def test_the_readme_is_a_page_a_newcomer_reads_in_five_minutes() -> None:
    assert len(README.splitlines()) <= 250


@pytest.mark.wire
def test_the_library_block_runs_as_pasted(wire_uri: str) -> None:
    (library,) = blocks("python", "asyncio.run(main())")
    env = {**os.environ, "MONGODB_URI": wire_uri}
    done = subprocess.run(
        [sys.executable, "-c", library], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0, 1, 2, 3]", "18 °C."]


def fake_model(code: str) -> Any:
    """A model of the kind the block's runtime takes, answering without a network."""
    if "from pydantic_ai import" in code:
        from pydantic_ai.models.test import TestModel

        return TestModel(custom_output_text="18 °C in Lyon.")
    if "from agents import" in code:
        from tests.test_openai_agents_session import ScriptedModel, text

        model = ScriptedModel()
        model.steps = [[text("18 °C.", "msg_1")], [text("21 °C.", "msg_2")]]
        return model
    from langchain_core.language_models import GenericFakeChatModel
    from langchain_core.messages import AIMessage

    return GenericFakeChatModel(messages=iter([AIMessage("Hello!"), AIMessage("18 °C.")]))


RUNTIME_BLOCKS = [
    pytest.param(code, id=re.search(r"integrations\.(\w+)|(SteeringInbox)", code).group(0))  # type: ignore[union-attr]
    for code in blocks("python")
    if "asyncio.run(main())" not in code
]


@pytest.mark.parametrize("code", RUNTIME_BLOCKS)
async def test_each_runtime_block_runs_inside_an_async_function(code: str, backend: Any) -> None:
    namespace: dict[str, Any] = {"db": backend.db, "model": fake_model(code)}
    source = "async def block():\n" + textwrap.indent(code, "    ")
    exec(compile(source, "README.md", "exec"), namespace)  # the README's own code

    await namespace["block"]()

    stored = await backend.db["agent_messages"].count_documents({})
    assert stored > 0, "the block stored nothing"


def test_the_curl_session_works_against_make_run(running: Running) -> None:  # noqa: F811
    (session,) = blocks("bash", "curl")
    env = {**os.environ, "TOKEN": running.token, "BASE": running.base}
    script = "set -euo pipefail\n" + session.replace("curl -s", "curl -sf")
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.replace("}{", "}\n{").splitlines()]
    assert answers[0] == {"status": "ok"}
    assert [m["content"] for m in answers[2]["data"]] == ["Hello", "Hi!"]
    assert "conv-hello" in [c["_id"] for c in answers[3]["data"]]


@pytest.mark.parametrize("code", blocks("bash", "make "))
def test_every_make_command_names_a_target_the_makefile_has(code: str) -> None:
    targets = re.findall(r"^\s*make (\w[\w-]*)", code, re.MULTILINE)
    makefile = (ROOT / "Makefile").read_text()
    assert targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), target


def test_every_link_of_the_readme_leads_to_a_file_of_the_checkout() -> None:
    missing = [
        link
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
        if not link.startswith("http") and not (ROOT / link).exists()
    ]
    assert missing == []


def test_no_block_is_left_unchecked() -> None:
    """Each block is one of the kinds the tests above run."""
    checked = (
        blocks("python", "asyncio.run(main())")
        + [param.values[0] for param in RUNTIME_BLOCKS]
        + blocks("bash", "curl")
        + blocks("bash", "make ")
    )
    assert sorted(checked) == sorted(code for _, code in BLOCKS)
