"""One grammar (docs/cli.md): every command that reads a model file takes --format/--trust/--key/--arch,
every command that writes takes --force, every command takes --json/-q/-v/--debug, and a usage error under
--json is one JSON document with exit code 2. Generated from the command table, so a new command is checked."""
from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from modelkit.cli import COMMANDS, EXIT_ERROR, main
from modelkit.formats import FORMATS

READS_A_MODEL = {"convert", "quantize", "prune", "distill", "eval", "generate", "inspect", "serve"}
WRITES = {"convert", "quantize", "prune", "distill", "train"}
EXPORTS_A_USER_MODULE = {"convert"}       # --input-shape (also --example-input), --dynamic
EXPORTS_A_CAUSAL_LM = {"convert"}         # --kv-cache
# Where a shared option does not apply, and why (docs/cli.md says the same).
WITHOUT = {
    ("inspect", "--arch"): "inspect reads headers only; it never builds a model",
}
OUTPUT = ("--json", "-q", "--quiet", "-v", "--verbose", "--debug")


def _command(name: str) -> click.Command:
    return main.get_command(click.Context(main), name)


def _option_names(name: str) -> set[str]:
    return {opt for p in _command(name).params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}


def test_the_tables_name_every_command():
    assert READS_A_MODEL | WRITES | EXPORTS_A_USER_MODULE | EXPORTS_A_CAUSAL_LM <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_takes_the_output_options(name):
    assert set(OUTPUT) <= _option_names(name)


@pytest.mark.parametrize("name", sorted(READS_A_MODEL))
def test_every_reading_command_takes_the_read_options(name):
    expected = {o for o in ("--format", "--trust", "--key", "--arch") if (name, o) not in WITHOUT}
    assert expected <= _option_names(name)


@pytest.mark.parametrize("name", sorted(WRITES))
def test_every_writing_command_takes_force(name):
    assert "--force" in _option_names(name)


@pytest.mark.parametrize("name", sorted(EXPORTS_A_USER_MODULE))
def test_every_exporting_command_takes_the_input_options(name):
    assert {"--input-shape", "--example-input", "--dynamic"} <= _option_names(name)


@pytest.mark.parametrize("name", sorted(EXPORTS_A_CAUSAL_LM))
def test_every_causal_lm_exporting_command_takes_kv_cache(name):
    assert "--kv-cache" in _option_names(name)


@pytest.mark.parametrize("name", sorted(READS_A_MODEL))
def test_format_choices_come_from_the_format_table(name):
    option = next(p for p in _command(name).params if "--format" in getattr(p, "opts", ()))
    assert tuple(option.type.choices) == tuple(sorted(FORMATS))


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_usage_error_under_json_is_one_json_document(name):
    result = CliRunner().invoke(main, [name, "--no-such-option", "--json"])
    assert result.exit_code == EXIT_ERROR, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "modelkit.error/1" and doc["ok"] is False
    assert doc["error"]["type"] == "UsageError" and "--no-such-option" in doc["error"]["message"]


def test_a_bad_choice_under_json_names_the_option():
    result = CliRunner().invoke(main, ["--json", "convert", "a", "b", "--format", "zip"])
    assert result.exit_code == EXIT_ERROR
    assert "--format" in json.loads(result.stdout)["error"]["message"]


def test_usage_errors_without_json_stay_click_messages():
    result = CliRunner().invoke(main, ["convert", "--no-such-option"])
    assert result.exit_code == EXIT_ERROR and "No such option" in result.stderr and result.stdout == ""


def test_output_options_work_before_and_after_the_command(tmp_path):
    missing = str(tmp_path / "missing.safetensors")
    for args in (["--json", "inspect", missing], ["inspect", missing, "--json"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == EXIT_ERROR
        assert json.loads(result.stdout)["error"]["type"] == "FormatError"
    for args in (["--debug", "inspect", missing], ["inspect", missing, "--debug"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == EXIT_ERROR and "Traceback" in result.stderr


def test_from_is_kept_as_another_name_for_format():
    option = next(p for p in _command("convert").params if "--format" in getattr(p, "opts", ()))
    assert "--from" in option.opts
