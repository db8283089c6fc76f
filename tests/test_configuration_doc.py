"""docs/CONFIGURATION.md is generated from the settings class and lists every setting."""

from __future__ import annotations

import pytest
from pydantic import Field

from app.settings import Settings
from scripts import configuration
from scripts.configuration import OUTPUT, render, variables


def test_every_setting_is_in_the_configuration_page() -> None:
    page = OUTPUT.read_text()
    for name, field in Settings.model_fields.items():
        for variable in variables(name, field):
            assert f"`{variable}`" in page, f"{variable} ({name}) is missing from {OUTPUT.name}"


def test_the_configuration_page_is_current() -> None:
    assert OUTPUT.read_text() == render(), "run `make configuration` and commit the result"


def test_a_new_setting_without_a_section_stops_the_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Grown(Settings):
        brand_new_setting: int = Field(default=1, description="A setting nobody placed yet.")

    monkeypatch.setattr(configuration, "Settings", Grown)
    with pytest.raises(SystemExit, match="brand_new_setting"):
        render()
