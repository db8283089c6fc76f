"""The library as a runtime installs it: a wheel holding `agent_store` and nothing else, used
from a project that has `app` and `migrations` packages of its own, on Python 3.11."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RUNTIME = """
import asyncio

from mongomock_motor import AsyncMongoMockClient

import app
import migrations
from agent_store import AgentMessageLogger, ConversationStore

assert app.OWN == "the runtime's own app", app.__file__
assert migrations.OWN == "the runtime's own migrations", migrations.__file__


async def main() -> None:
    db = AsyncMongoMockClient(tz_aware=True)["runtime"]
    logger = AgentMessageLogger(db)
    await logger.ensure_indexes()
    await logger.log_messages(
        "conv-1",
        [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"}],
        user_id="user-1",
        turn_id="turn-1",
    )
    transcript = await ConversationStore(db).transcript("conv-1")
    print([(m.seq, m.role, m.content) for m in transcript])


asyncio.run(main())
"""


INSTALLED_FILES = """
from importlib.metadata import distribution
files = distribution("agent-conversation-store").files or []
print(*sorted({str(f).split("/")[0] for f in files}))
"""


def python311() -> str:
    candidates = [os.environ.get("PYTHON311"), shutil.which("python3.11")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.11*/bin/python3.11")))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"],
                               capture_output=True, text=True)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 11)":
            return candidate
    pytest.fail("no Python 3.11 found: set PYTHON311=/path/to/python3.11")


def run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--wheel", "--outdir", out, ROOT)
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_holds_agent_store_and_its_metadata_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}

    assert {t for t in top if not t.endswith(".dist-info")} == {"agent_store"}
    assert "agent_store/py.typed" in names


def test_a_runtime_with_its_own_app_and_migrations_logs_and_reads_on_python_311(
    wheel: Path, tmp_path: Path
) -> None:
    project = tmp_path / "runtime"
    for package in ("app", "migrations"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f'OWN = "the runtime\'s own {package}"\n')
    (project / "main.py").write_text(textwrap.dedent(RUNTIME))
    venv = tmp_path / "venv"
    run(python311(), "-m", "venv", venv)
    pip = venv / "bin" / "pip"
    run(pip, "install", "--quiet", wheel, "mongomock-motor", "typing_extensions")

    out = run(venv / "bin" / "python", "main.py", cwd=project)

    assert out.strip() == "[(0, 'user', 'Hello'), (1, 'assistant', 'Hi!')]"
    installed = run(venv / "bin" / "python", "-c", INSTALLED_FILES).split()
    assert [name for name in installed if not name.endswith(".dist-info")] == ["agent_store"]
