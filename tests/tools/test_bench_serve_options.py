"""The click options `ignis-bench` and `serve_overhead` share (`ignis.tools.bench.serve.options`):
one parser for the concurrency lists, one declaration each of --max-tokens, --seed and --json-out."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ignis.tools.bench import serve_overhead
from ignis.tools.bench.serve import cli as bench_cli
from ignis.tools.bench.serve import options


def _params(cmd: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in cmd.params if p.name}


def test_int_list_parses_and_refuses() -> None:
    assert options.int_list(None, None, "1, 8,16") == [1, 8, 16]  # type: ignore[arg-type]
    assert options.int_list(None, None, None) is None  # type: ignore[arg-type]
    for bad, msg in (("1,x", "comma-separated integers"), ("0,8", ">= 1"), (",", ">= 1")):
        with pytest.raises(click.BadParameter, match=msg):
            options.int_list(None, None, bad)  # type: ignore[arg-type]


def test_both_commands_declare_the_shared_options() -> None:
    bench, overhead = _params(bench_cli.main), _params(serve_overhead.main)
    assert bench["concurrency"].callback is options.int_list
    assert overhead["lanes"].callback is options.int_list
    assert bench["input_len"].callback is options.int_list
    for name in ("max_tokens", "seed", "json_out"):
        assert type(bench[name].type) is type(overhead[name].type), name
    assert overhead["max_tokens"].type.min == 2 and bench["max_tokens"].type.min == 1  # type: ignore[attr-defined]
    assert bench["json_out"].type.type is Path is overhead["json_out"].type.type  # type: ignore[attr-defined]


def test_the_same_refusal_from_both_commands() -> None:
    runner = CliRunner()
    a = runner.invoke(bench_cli.main, ["--concurrency", "0"])
    b = runner.invoke(serve_overhead.main, ["--lanes", "0", "--synthetic"])
    assert a.exit_code == b.exit_code == 2
    assert "every value must be >= 1, got '0'" in a.output and "every value must be >= 1, got '0'" in b.output
