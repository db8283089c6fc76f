"""Rules of the code's shape that no linter states: short functions, a public surface in one
file, internals kept private."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import agent_store

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
DATA_MODULES = {"app/examples.py", "app/demo.py"}
"""Modules whose long functions are literals of example data, not logic."""


def functions() -> list[tuple[str, str, int]]:
    found = []
    for package in ("agent_store", "app", "migrations"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative in DATA_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    assert node.end_lineno is not None
                    found.append((relative, node.name, node.end_lineno - node.lineno + 1))
    return found


def test_no_function_is_longer_than_sixty_lines() -> None:
    long = [f"{path}:{name} ({lines} lines)" for path, name, lines in functions()
            if lines > MAX_FUNCTION_LINES]  # fmt: skip
    assert long == []


@pytest.mark.parametrize("name", agent_store.__all__)
def test_every_public_name_is_documented(name: str) -> None:
    value = getattr(agent_store, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        assert inspect.getdoc(value), f"agent_store.{name} has no docstring"


def store_types(hint: object) -> set[type]:
    """The classes of agent_store a type hint names, however nested in unions and generics."""
    found = set()
    if isinstance(hint, type) and hint.__module__.startswith("agent_store"):
        found.add(hint)
    for argument in typing.get_args(hint):
        found |= store_types(argument)
    return found


@pytest.mark.parametrize("cls_name", ["AgentMessageLogger", "ConversationStore", "LegacyTurns"])
def test_every_type_a_public_method_takes_or_returns_is_exported(cls_name: str) -> None:
    cls = getattr(agent_store, cls_name)
    named = set()
    for name, method in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") or name == "__init__":
            for hint in typing.get_type_hints(method).values():
                named |= store_types(hint)
    assert {t.__name__ for t in named} - set(agent_store.__all__) == set()


def test_modules_below_the_packages_are_private() -> None:
    public = []
    for package in ("core", "store", "legacy"):
        for path in (ROOT / "agent_store" / package).glob("*.py"):
            if path.name != "__init__.py" and not path.name.startswith("_"):
                public.append(str(path.relative_to(ROOT)))
    assert public == []


LOOP_FREE = {
    ("_driver.py", "sleep"): "`pause`, the store's one wait, when an event loop runs it",
    ("_reads.py", "iscoroutine"): "`_at_once` tells the synchronous driver's awaitables apart",
    ("_reads.py", "isfuture"): "`_at_once` tells the synchronous driver's awaitables apart",
    ("_reads.py", "ensure_future"): "`_at_once`: only for a coroutine or a future",
    ("_reads.py", "Task"): "a type hint",
    ("_indexes.py", "Lock"): "`ensure_indexes`, which no caller runs over a synchronous Database",
    ("_appends.py", "current_task"): "`adder`: none with no event loop (a thread appends)",
    ("_appends.py", "Task"): "a type hint",
    ("langchain.py", "to_thread"): "the async methods, which run the sync ones in a thread",
}
"""Each use of asyncio in the code a synchronous Database reaches (the store, and LangChain's
history over it), and why the synchronous driver (`run_sync`, no event loop) runs it."""
SYNC_REACHED = ["core/*.py", "store/*.py", "integrations/_appends.py", "integrations/langchain.py"]


def loop_calls(path: Path) -> set[tuple[str, str]]:
    """The asyncio names a module uses, and its `time.sleep`, by module name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module in ("asyncio", "time"):
            found |= {(path.name, f"from {node.module} import {a.name}") for a in node.names}
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
            continue
        if node.value.id == "asyncio" or (node.value.id, node.attr) == ("time", "sleep"):
            found.add((path.name, node.attr))
    return found


def test_the_store_waits_only_through_pause_which_the_synchronous_driver_can_run() -> None:
    """The store's code runs with no event loop under the synchronous driver (LangChain's
    sync methods, `run_sync`): a wait (a retry within `claim_grace`, a delete's last sweep)
    goes through `pause`, which blocks there, and no other asyncio primitive is used."""
    used = set()
    for pattern in SYNC_REACHED:
        for path in sorted((ROOT / "agent_store").glob(pattern)):
            used |= loop_calls(path)
    assert ("_driver.py", "sleep") in used  # the scan sees `pause` itself
    assert used <= set(LOOP_FREE)
