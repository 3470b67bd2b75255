"""docs/configuration.md holds the table daemon/options.py generates, so the
documented flags, variables and defaults are the ones ``kvsidecar serve`` has."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.daemon import options_doc
from kvsidecar.daemon.options import OPTIONS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_doc_is_the_generated_table() -> None:
    text = DOC.read_text()
    assert options_doc.splice(text, options_doc.render()) == text, (
        "docs/configuration.md is out of date: run python -m kvsidecar.daemon.options_doc")


def test_every_flag_and_variable_is_documented_once() -> None:
    table = options_doc.render()
    for o in OPTIONS:
        assert table.count(f"| `{o.flag}` |") == 1, o.flag
        assert f"`{o.env}`" in table or f"`{o.env}=1`" in table, o.env
        assert o.shown_default() in table


def test_a_stale_table_is_replaced_and_prose_kept() -> None:
    stale = f"intro\n\n{options_doc.BEGIN_MARK} old -->\n| `--gone` |\n{options_doc.END}\noutro\n"
    out = options_doc.splice(stale, options_doc.render())
    assert out == f"intro\n\n{options_doc.render()}\noutro\n"
    assert "--gone" not in out


def test_missing_markers_are_an_error() -> None:
    with pytest.raises(ValueError, match="options:begin"):
        options_doc.splice("no table here", options_doc.render())
    with pytest.raises(ValueError, match="options:end"):
        options_doc.splice(f"{options_doc.BEGIN_MARK} -->", options_doc.render())


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"{options_doc.BEGIN_MARK} -->\n{options_doc.END}\n")
    assert options_doc.main([str(doc), "--check"]) == 1
    assert options_doc.main([str(doc)]) == 0
    assert options_doc.main([str(doc), "--check"]) == 0
    assert options_doc.render() in doc.read_text()
