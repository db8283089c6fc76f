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
