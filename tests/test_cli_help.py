"""`--help` of every command: it answers at once (no torch, diffusers, accelerate, datasets or safetensors is
imported for it), shows a usage line, and gives every flag a help line with its default.

The commands: every `dit-accel` sub-command (dit_accel.cli.COMMANDS), `dit-plan`, and `python -m
dit_accel.train` (run as __main__, as the launcher runs it). One fresh interpreter runs them all in turn and
reports, per command, its exit code, its output and the heavy modules it imported.
"""

import argparse
import contextlib
import io
import json
import subprocess
import sys

import pytest

from dit_accel.cli import COMMANDS

HEAVY = ("torch", "diffusers", "accelerate", "datasets", "safetensors")

EVERY_HELP = f"""
import contextlib, io, json, runpy, sys
HEAVY = {HEAVY!r}

def run(call):
    out, before = io.StringIO(), set(sys.modules)
    with contextlib.redirect_stdout(out):
        try:
            code = call()
        except SystemExit as done:
            code = done.code
    return {{"code": code, "out": out.getvalue(), "heavy": sorted(set(HEAVY) & (set(sys.modules) - before))}}

def trainer_module():
    sys.argv = ["dit_accel.train", "--help"]
    runpy.run_module("dit_accel.train", run_name="__main__")

from dit_accel.cli import COMMANDS, main as dit_accel
from planner.cli import main as dit_plan

report = {{name: run(lambda: dit_accel([name, "--help"])) for name in COMMANDS}}
report["dit-plan"] = run(lambda: dit_plan(["--help"]))
report["python -m dit_accel.train"] = run(trainer_module)
report["loaded"] = sorted(set(HEAVY) & set(sys.modules))
print(json.dumps(report))
"""


def test_help_of_every_command_imports_no_gpu_stack():
    result = subprocess.run([sys.executable, "-c", EVERY_HELP], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report.pop("loaded") == []
    assert set(report) == {*COMMANDS, "dit-plan", "python -m dit_accel.train"}
    for name, outcome in report.items():
        assert outcome["code"] in (0, None), (name, outcome)
        assert outcome["heavy"] == [], f"{name} --help imported {outcome['heavy']}"
        assert outcome["out"].startswith("usage: ") and "--" in outcome["out"], name
    # `dit-accel train --help`: its own launcher flags first, then every trainer flag
    assert "--num-processes" in report["train"]["out"] and "--max-steps" in report["train"]["out"]


def _parsers_shown(call, monkeypatch) -> list[argparse.ArgumentParser]:
    """The parsers whose help `call` printed."""
    shown, real = [], argparse.ArgumentParser.format_help

    def format_help(parser):
        shown.append(parser)
        return real(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "format_help", format_help)
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            assert call() in (0, None)
        except SystemExit as done:
            assert done.code in (0, None)
    monkeypatch.undo()
    return shown


@pytest.mark.parametrize("name", sorted(COMMANDS) + ["python -m dit_accel.train"])
def test_every_flag_has_a_help_line_with_its_default(name, monkeypatch):
    from dit_accel.cli import main as dit_accel
    from dit_accel.train.loop import main as trainer

    call = (
        (lambda: trainer(["--help"])) if name.startswith("python") else (lambda: dit_accel([name, "--help"]))
    )
    parsers = _parsers_shown(call, monkeypatch)
    assert parsers, name
    for parser in parsers:
        formatter = parser.formatter_class(prog=parser.prog)
        for action in parser._actions:
            if action.dest in ("help", "version"):
                continue
            flag = "/".join(action.option_strings) or action.dest
            assert action.help and action.help != argparse.SUPPRESS, f"{parser.prog} {flag} has no help"
            text = formatter._get_help_string(action)  # the line as --help prints it, before %-formatting
            if action.option_strings and action.default not in (None, "", argparse.SUPPRESS):
                assert "default" in text.lower(), f"{parser.prog} {flag}: no default in {text!r}"
            elif action.option_strings and not action.required:  # what happens when it is not given
                said = ("default", "required", "unless", "not given", "without it", "if given", "only with")
                assert any(word in text.lower() for word in said), (
                    f"{parser.prog} {flag}: {text!r} says no default"
                )


def test_defaults_are_shown_as_typed():
    from dit_accel.train.config import build_parser

    text = " ".join(build_parser().format_help().split())  # the lines as one, unwrapped
    assert "(default: 0.9 0.999)" in text and "(default: 400000)" in text and "(default: off)" in text
    assert "a plain line every 10% in a log" in text  # a % in a help line is text, not a format
