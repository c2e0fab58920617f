"""deploy/README.md documents every setting: its table is the one gen_settings_table.py makes."""

from __future__ import annotations

import pytest
from deploy_helpers import DEPLOY, load_deploy_module, setting_env_names

from kvhandoff.settings import Settings

gen = load_deploy_module("gen_settings_table.py")


def test_readme_settings_table_is_current() -> None:
    current = gen.readme_table((DEPLOY / "README.md").read_text())
    assert current == gen.table(), (
        "deploy/README.md settings table is stale: run "
        "`.venv/bin/python deploy/gen_settings_table.py --write`")


def test_table_has_one_row_per_setting_in_field_order() -> None:
    rows = gen.rows()
    assert [r[0].strip("`") for r in rows] == list(setting_env_names())
    for r, (name, field) in zip(rows, Settings.model_fields.items(), strict=True):
        assert " ".join((field.description or "").split()) == r[4].replace("\\|", "|"), name


def test_serve_flags_column_matches_the_serve_command() -> None:
    flags = gen.serve_flags()
    # every serve option overrides a real setting, and the ones the issue names are there
    assert set(flags) <= set(Settings.model_fields)
    assert {"host", "port", "auth_token", "require_rdma"} <= set(flags)
    assert flags["require_rdma"] == "`--require-rdma` / `--allow-tcp`"


def test_a_stale_table_is_detected() -> None:
    text = (DEPLOY / "README.md").read_text()
    stale = text.replace("| `KVHANDOFF_PORT` |", "| `KVHANDOFF_PORTT` |", 1)
    assert stale != text
    assert gen.readme_table(stale) != gen.table()
    assert gen.readme_table(gen.with_table(stale)) == gen.table()


def test_missing_markers_are_an_error_that_says_what_to_add() -> None:
    with pytest.raises(ValueError, match="settings-table:begin"):
        gen.readme_table("# no table here\n")
