"""Every option a user can type has help text: `dra-driver COMMAND --help` and the
benchmarks' `--help` are where a newcomer looks first (issue 40)."""

from __future__ import annotations

import argparse

import pytest

from bench import __main__ as bench_main
from bench import realapi
from driver import cli


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    return [a.option_strings[-1] for a in parser._actions
            if a.option_strings and not a.help and not isinstance(a, argparse._HelpAction)]


def _commands() -> dict[str, argparse.ArgumentParser]:
    top = cli.parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_option_of_every_command_says_what_it_does(command):
    assert _undocumented(_commands()[command]) == []


@pytest.mark.parametrize("parser", [bench_main.build_parser, realapi.build_parser],
                         ids=["bench", "bench.realapi"])
def test_every_benchmark_option_says_what_it_does(parser):
    assert _undocumented(parser()) == []


def test_the_readme_lists_every_option_with_its_variable():
    """The configuration table (docs/configuration.md, linked from the README) is the one
    place a user reads the options without running the command: one row per option, its
    flag and its environment variable (--nri-socket was missing from it)."""
    import re
    from pathlib import Path

    from driver.service import config

    readme = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `--")]
    missing = [o.flag for o in config.OPTIONS
               if not any(re.search(rf"`{re.escape(o.flag)}`", r) and f"`{o.env}`" in r for r in rows)]
    assert missing == []
