"""`ignis-inspect`: print a `.ninfer` container's metadata and tensor table; `--verify` checks every crc32.

Run it as `ignis-inspect FILE` or `python -m ignis.tools.inspect FILE` (not `python tools/inspect.py`:
that would shadow the standard library's `inspect` module).

Exit status: 0 the file is valid (and, with --verify, every checksum and padding byte is right);
1 --verify found corrupt data; 2 the file is not a valid container, cannot be read, or is an artifact
directory (not supported yet).
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from ignis.formats import ChecksumMismatchError, FormatError, NinferReader, NonZeroPaddingError

EXIT_CORRUPT_DATA = 1
EXIT_INVALID = 2

_MAX_VALUE_CHARS = 100


class _Invalid(click.ClickException):
    exit_code = EXIT_INVALID


def _short(value: Any) -> str:
    """One-line rendering of a metadata value, truncated for long strings, blobs and structures."""
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, str) and len(value) > _MAX_VALUE_CHARS:
        return repr(value[:60])[:-1] + f"...' ({len(value)} chars)"
    text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        kind = f"{len(value)} items" if isinstance(value, (list, dict)) else type(value).__name__
        return text[: _MAX_VALUE_CHARS - 20] + f"... ({kind})"
    return text


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def _print_file(r: NinferReader) -> None:
    data = sum(t.length for t in r.tensors.values())
    click.echo(f"{r.path}: .ninfer v{r.version}, {r.file_size} bytes ({_size(r.file_size)})")
    click.echo(f"header: {r.header_length} bytes at offset {r.header_offset}")
    click.echo(f"metadata: {len(r.metadata)} key(s)")
    for key in sorted(r.metadata):
        click.echo(f"  {key} = {_short(r.metadata[key])}")
    click.echo(f"tensors: {len(r)} ({data} bytes of data, {_size(data)})")
    rows = [("name", "dtype", "shape", "offset", "length", "crc32")]
    for t in r.tensors.values():
        shape = "[" + ", ".join(map(str, t.shape)) + "]"
        rows.append((t.name, t.dtype, shape, str(t.offset), str(t.length), f"{t.crc32:08x}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        click.echo("  " + "  ".join(cells).rstrip())


def _verify(r: NinferReader) -> bool:
    start = time.perf_counter()
    bad: list[str] = []
    for name in r:
        try:
            r.verify_tensor(name)
        except ChecksumMismatchError as exc:
            bad.append(name)
            click.echo(f"MISMATCH {exc}", err=True)
    padding_ok = True
    if not bad:
        try:
            r.verify(names=[], check_padding=True)
        except NonZeroPaddingError as exc:
            padding_ok = False
            click.echo(f"BAD PADDING {exc}", err=True)
    seconds = time.perf_counter() - start
    total = sum(t.length for t in r.tensors.values())
    if bad:
        click.echo(
            f"verify: FAILED: {len(bad)} of {len(r)} tensor(s) do not match their crc32: {bad}", err=True
        )
        return False
    if not padding_ok:
        click.echo("verify: FAILED: non-zero padding", err=True)
        return False
    click.echo(f"verify: ok: {len(r)} tensor(s), {total} bytes, crc32 and padding checked in {seconds:.2f} s")
    return True


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True, path_type=str))
@click.option(
    "--verify",
    is_flag=True,
    help="Also read every tensor and check its crc32 and all padding bytes; exit 1 if any tensor is "
    "corrupt (every corrupt tensor is listed).",
)
def main(path: str, verify: bool) -> None:
    """Print the metadata and tensor table of the .ninfer container PATH.

    The header is validated in full before anything is printed; an invalid file is reported with the
    offending tensor and byte offset and exits 2.
    """
    if os.path.isdir(path):
        raise _Invalid(
            f"{path} is a directory: verifying a whole artifact is not implemented yet -- it needs the "
            f"artifact manifest (issue 5). Pass one .ninfer file."
        )
    try:
        with NinferReader(path) as r:
            _print_file(r)
            if verify and not _verify(r):
                raise SystemExit(EXIT_CORRUPT_DATA)
    except FormatError as exc:
        raise _Invalid(f"invalid .ninfer file ({type(exc).__name__}): {exc}") from exc


if __name__ == "__main__":
    main()
