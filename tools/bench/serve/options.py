"""Click options shared by the benches that drive `ignis-run` over its socket: `ignis-bench`
(`ignis.tools.bench.serve.cli`) and `python -m ignis.tools.bench.serve_overhead`.

Each factory returns one `click.option` decorator; the flag names, defaults and help that differ
between the commands are arguments, the parsing (and its error messages) is this module's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

__all__ = ["concurrency_option", "int_list", "json_out_option", "max_tokens_option", "seed_option"]

F = TypeVar("F", bound=Callable[..., Any])


def int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """Click callback: "1,8" -> [1, 8] (None stays None).

    Raises:
        click.BadParameter: a value that is not an integer, none at all, or one below 1.
    """
    if value is None:
        return None
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"every value must be >= 1, got {value!r}")
    return out


def concurrency_option(*names: str, default: str, help: str) -> Callable[[F], F]:
    """Requests in flight, a comma-separated list of integers >= 1 (a sweep), parsed by `int_list`;
    `names` are click's (flags, then the parameter name)."""
    return click.option(
        *names, default=default, show_default=True, callback=int_list, metavar="N[,N...]", help=help
    )


def max_tokens_option(*, default: int | None, minimum: int = 1, help: str) -> Callable[[F], F]:
    """--max-tokens: output tokens per request, an integer >= `minimum`."""
    return click.option(
        "--max-tokens",
        type=click.IntRange(min=minimum),
        default=default,
        show_default=default is not None,
        help=help,
    )


def seed_option(*, help: str) -> Callable[[F], F]:
    """--seed: an integer, 0 by default."""
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def json_out_option(*, help: str) -> Callable[[F], F]:
    """--json-out: a file path (a `Path`) the report is written to."""
    return click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), help=help)
