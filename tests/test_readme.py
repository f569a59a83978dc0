"""The README stays true: every setting is documented, and the two commands are there."""

from __future__ import annotations

from pathlib import Path

from wheelhouse.config import documented_settings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_setting_is_in_the_readme_table() -> None:
    text = README.read_text()
    table = text.split("<!-- settings:start -->")[1].split("<!-- settings:end -->")[0]
    for variable, _default, doc in documented_settings():
        assert f"`{variable}`" in table, f"{variable} is missing from the README table"
        assert doc, f"{variable} has no docstring in wheelhouse/config.py"


def test_readme_shows_the_two_commands() -> None:
    text = README.read_text()
    assert "wheelhouse serve" in text
    assert ".ci/test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert ".ci/test" in ci
