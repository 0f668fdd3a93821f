"""`ignis-inspect`: print a `.ninfer` container's metadata and tensor table; `--verify` checks every crc32.

Run it as `ignis-inspect FILE` or `python -m ignis.tools.inspect_artifact FILE`.

`ignis-inspect DIR` prints an artifact directory's manifest (card, widths, files, modules, parts)
and checks that every listed file is present with its size and every `.ninfer` header is valid;
`ignis-inspect DIR --verify` checks the whole artifact against it: every listed file present with its
size and sha256 (the first corrupt 16 MiB block of each file named by offset), no unlisted file, and
every `.ninfer` container's tensor crc32s and padding (naming the tensor and offset).

Exit status: 0 the file or artifact is valid (and, with --verify, every checksum and padding byte is
right); 1 --verify found corrupt data; 2 the file is not a valid container, the directory has no valid
manifest, or a listed file is missing or of the wrong size (or, with --verify, a file is unlisted).

Everything read from a file (tensor names, metadata keys, manifest fields, and the error messages that
quote them) is printed escaped: a string with a character that is not printable (control characters
such as ESC or newline, format characters such as the bidi overrides, line separators) is shown as its
Python literal, so a crafted file cannot drive the terminal or forge output lines.
"""

from __future__ import annotations

import os
import time
from typing import Any

import click

from ignis.formats import (
    ArtifactChecksumError,
    ArtifactFileError,
    ChecksumMismatchError,
    FormatError,
    NinferReader,
    NonZeroPaddingError,
    read_manifest,
    verify_artifact,
)

EXIT_CORRUPT_DATA = 1
EXIT_INVALID = 2

_MAX_VALUE_CHARS = 100


class _Invalid(click.ClickException):
    exit_code = EXIT_INVALID


def _escape(text: str) -> str:
    """`text` with every non-printable character (`str.isprintable`: Unicode categories Cc, Cf, Cs, Co,
    Cn, Zl, Zp and every space but U+0020) written as a `\\xNN` / `\\uNNNN` / `\\UNNNNNNNN` escape."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _safe(text: Any) -> str:
    """A name, key or path from a file, for one line of output: unchanged when every character is
    printable, else its Python literal (quoted, backslashes and non-printable characters escaped) so an
    escaped name cannot be mistaken for a plain one."""
    text = str(text)
    return text if text.isprintable() else repr(text)


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
    click.echo(f"{_safe(r.path)}: .ninfer v{r.version}, {r.file_size} bytes ({_size(r.file_size)})")
    click.echo(f"header: {r.header_length} bytes at offset {r.header_offset}")
    click.echo(f"metadata: {len(r.metadata)} key(s)")
    for key in sorted(r.metadata):
        click.echo(f"  {_safe(key)} = {_short(r.metadata[key])}")
    click.echo(f"tensors: {len(r)} ({data} bytes of data, {_size(data)})")
    rows = [("name", "dtype", "shape", "offset", "length", "crc32")]
    for t in r.tensors.values():
        shape = "[" + ", ".join(map(str, t.shape)) + "]"
        rows.append((_safe(t.name), _safe(t.dtype), shape, str(t.offset), str(t.length), f"{t.crc32:08x}"))
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
            click.echo(f"MISMATCH {_escape(str(exc))}", err=True)
    padding_ok = True
    if not bad:
        try:
            r.verify(names=[], check_padding=True)
        except NonZeroPaddingError as exc:
            padding_ok = False
            click.echo(f"BAD PADDING {_escape(str(exc))}", err=True)
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


def _print_manifest(path: str, m: Any) -> None:
    click.echo(
        f"{_safe(path)}: ignis artifact {m.name!r} (manifest v{m.version}, .ninfer v{m.ninfer_version})"
    )
    click.echo(
        f"card {_safe(m.card)} (arch {_safe(m.arch)}), family {_safe(m.family)}, dtypes linear "
        f"{_safe(m.linear_dtype)} / other {_safe(m.other_dtype)}, widths {list(m.widths)}"
    )
    click.echo(
        f"weights {_safe(m.weights)}; mtp {_safe(m.mtp or 'none')}; drafter "
        f"{'none' if m.drafter is None else repr(m.drafter.get('prefix'))}; shortlist "
        f"{'none' if m.shortlist is None else m.shortlist.get('size')}; tokenizer "
        f"{'stored' if m.tokenizer else 'none'}; chat template "
        f"{'stored' if m.chat_template else 'none'}"
    )
    total = sum(f.size for f in m.files)
    click.echo(f"files: {len(m.files)} ({total} bytes, {_size(total)})")
    rows = [(_safe(f.path), _safe(f.role), str(f.size), _safe(f.sha256[:16])) for f in m.files]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        cells = [c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        click.echo("  " + "  ".join(cells).rstrip())
    click.echo(f"modules: {len(m.modules)}")
    for mod in m.modules:
        click.echo(
            f"  width {mod.width:>2}: {_safe(mod.file)} ({_safe(mod.route)}, {len(mod.functions)} function(s)"
            f"{', dynamic rows' if mod.dynamic_rows else ''})"
        )
    if m.kernels:  # the compiled non-linear kernels the runtime loads (manifest v2 `kernels`)
        click.echo(f"kernels: {len(m.kernels)}")
        for k in m.kernels:
            dtypes = ", ".join(_safe(d) for d in k.dtypes)
            click.echo(f"  {_safe(k.kind)} (abi {k.abi}): {_safe(k.file)} :: {_safe(k.name)} [{dtypes}]")
    spec = m.profile.get("spec") or {}
    for kind, vals in sorted(spec.items()):
        click.echo(f"profile spec {_safe(kind)}: {_escape(str(vals))}")
    prov = m.provenance
    inputs = prov.get("inputs") or []
    click.echo(f"built by ignis {_safe(prov.get('ignis_version'))} from {len(inputs)} input file(s)")


def _inspect_dir(path: str, verify: bool) -> None:
    try:
        m = read_manifest(path)
    except FormatError as exc:
        raise _Invalid(f"invalid artifact ({type(exc).__name__}): {_escape(str(exc))}") from exc
    _print_manifest(path, m)
    if not verify:
        try:  # cheap: presence and sizes (a stat per file), so a truncated artifact never exits 0
            verify_artifact(path, m, check_hashes=False, allow_extra=True)
        except ArtifactFileError as exc:
            for p in exc.problems:
                click.echo(f"BAD FILE {_escape(str(p))}", err=True)
            raise _Invalid(
                f"{len(exc.problems)} problem(s) with the artifact's files (run with --verify for checksums)"
            ) from exc
        for rel in [m.weights, *([m.mtp] if m.mtp else [])]:  # headers validated, as the loader does
            try:
                with NinferReader(os.path.join(path, rel)):
                    pass
            except FormatError as exc:
                raise _Invalid(
                    f"invalid .ninfer file in the artifact ({type(exc).__name__}): {_escape(str(exc))}"
                ) from exc
        return
    start = time.perf_counter()
    problems: list[str] = []
    try:
        verify_artifact(path, m, check_hashes=True, allow_extra=False)
    except ArtifactFileError as exc:
        for p in exc.problems:
            click.echo(f"BAD FILE {_escape(str(p))}", err=True)
        raise _Invalid(f"verify: FAILED: {len(exc.problems)} problem(s) with the artifact's files") from exc
    except ArtifactChecksumError as exc:
        sizes = {f.path: f.size for f in m.files}
        for rel, offset in exc.mismatches:
            if offset >= sizes.get(rel, 0):  # every block matches its hash: the whole-file entry is off
                click.echo(
                    f"MISMATCH {_safe(os.path.join(path, rel))}: sha256 differs from the manifest although "
                    f"every block matches its block hash: the manifest's sha256 of this file is damaged",
                    err=True,
                )
                problems.append(rel)
                continue
            end = max(offset, min(offset + m.block_size, sizes.get(rel, 0)) - 1)
            click.echo(
                f"MISMATCH {_safe(os.path.join(path, rel))}: sha256 differs from the manifest (first corrupt "
                f"block: bytes {offset} to {end}; blocks are {_size(m.block_size)})",
                err=True,
            )
            problems.append(rel)
    for rel in [m.weights, *([m.mtp] if m.mtp else [])]:
        full = os.path.join(path, rel)
        try:
            with NinferReader(full) as r:
                r.verify()
        except ChecksumMismatchError as exc:
            click.echo(f"MISMATCH {_escape(str(exc))} (corrupt tensor(s): {exc.mismatches})", err=True)
            problems.append(rel)
        except FormatError as exc:
            click.echo(f"INVALID {type(exc).__name__}: {_escape(str(exc))}", err=True)
            problems.append(rel)
    seconds = time.perf_counter() - start
    if problems:
        click.echo(f"verify: FAILED: {len(set(problems))} corrupt file(s): {sorted(set(problems))}", err=True)
        raise SystemExit(EXIT_CORRUPT_DATA)
    total = sum(f.size for f in m.files)
    click.echo(
        f"verify: ok: {len(m.files)} file(s), {total} bytes, sha256 and .ninfer crc32/padding checked "
        f"in {seconds:.2f} s"
    )


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit status: 0 valid (with --verify: every checksum and padding byte right); 1 --verify found "
    "corrupt data (each corrupt tensor, or file and byte range, is named); 2 not a valid container or "
    "artifact: a bad header, no valid manifest.json, a listed file missing or of the wrong size (with "
    "--verify, also an unlisted file).",
)
@click.argument("path", type=click.Path(exists=True, path_type=str))
@click.option(
    "--verify",
    is_flag=True,
    help="Also read every tensor and check its crc32 and all padding bytes; exit 1 if any tensor is "
    "corrupt (every corrupt tensor is listed). For an artifact directory: also check every file's size "
    "and sha256 against manifest.json, refuse unlisted files, and check every .ninfer container.",
)
def main(path: str, verify: bool) -> None:
    """Print the metadata and tensor table of the .ninfer container PATH, or the manifest of the
    artifact directory PATH.

    The header is validated in full before anything is printed; an invalid file is reported with the
    offending tensor and byte offset and exits 2.
    """
    if os.path.isdir(path):
        _inspect_dir(path, verify)
        return
    if not os.path.isfile(path):  # a FIFO would block in open(); devices and sockets are no containers
        raise _Invalid(f"{_safe(path)}: not a regular file (a .ninfer container) nor an artifact directory")
    try:
        with NinferReader(path) as r:
            _print_file(r)
            if verify and not _verify(r):
                raise SystemExit(EXIT_CORRUPT_DATA)
    except FormatError as exc:
        raise _Invalid(f"invalid .ninfer file ({type(exc).__name__}): {_escape(str(exc))}") from exc


if __name__ == "__main__":
    main()
