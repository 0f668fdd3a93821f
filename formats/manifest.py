"""The artifact manifest (`manifest.json`): what an artifact directory holds, bytes-level.

An ignis artifact is a directory::

    NAME/
      manifest.json              this schema (UTF-8 JSON, keys sorted, 2-space indent, final newline)
      NAME.ninfer                target weights (+ grafted drafter, shortlist head, tokenizer, config)
      NAME_mtp.ninfer            the MTP companion container (only when the checkpoint has `mtp.*`)
      modules/<card>/*.so        compiled TVM modules for the verify row widths of the card, and
                                 compiled kernels of non-linear functions (the drafter's top-k,
                                 the fused Gated DeltaNet recurrence, the fused row norms)

The manifest names every other file with its size and sha256 (and the sha256 of each
`block_size`-byte block, so a corrupt byte can be located), the format versions, the card and its
widths, where the tokenizer and chat template are stored, the compiled functions of each module, the
card profile's defaults and the build provenance. It holds no timestamps: building the same inputs
twice gives byte-identical manifests (and artifacts).

Schema, version 2 (every key required; `null` where the artifact has no such part; version 1 is
the same without `kernels`, and is still read: see "Versions" below):

| key            | type                  | meaning                                                      |
|----------------|-----------------------|--------------------------------------------------------------|
| format         | "ignis-artifact"      | identifies the file                                          |
| version        | 2 (or 1)              | this schema's version (`MANIFEST_VERSION`)                   |
| ninfer_version | int                   | `.ninfer` container version of the weight files              |
| name           | str                   | artifact name (the NAME of the files)                        |
| card           | str                   | card profile name ("h200", "cpu", ...)                       |
| arch           | str                   | TVM/CUDA arch of the modules ("sm_90", "sm_120", "llvm")     |
| family         | str                   | model family (HF model_type)                                 |
| linear_dtype   | str                   | stored dtype of the linear weights ("q4_g32", "bf16", "f32") |
| other_dtype    | str                   | stored dtype of every other tensor                           |
| widths         | [int]                 | verify row widths compiled (ascending, unique, 1..64)         |
| weights        | str                   | the target's `.ninfer` file (a `files` path)                 |
| mtp            | str or null           | the MTP companion `.ninfer` (a `files` path)                 |
| tokenizer      | location or null      | {file, tensor, metadata_key, sha256}: tokenizer.json bytes   |
| chat_template  | location or null      | {file, metadata_key, sha256}: the default template (UTF-8)   |
| drafter        | object or null        | {kind, file, prefix, config_key}: grafted drafter            |
| shortlist      | object or null        | {file, prefix, size, vocab_size, source}: Q4 shortlist head   |
| modules        | [module]              | {width, file, target, route, dynamic_rows, functions}; a     |
|                |                       | width may have several modules (one per route), a file may   |
|                |                       | serve several widths; (width, kind, N, K, dtype) is unique    |
| kernels        | [kernel]              | {name, kind, abi, file, target, dtypes}: compiled non-linear |
|                |                       | functions (version 2 only; `[]` when none); (kind, dtype) is  |
|                |                       | unique                                                       |
| files          | [file]                | {path, role, size, sha256, block_sha256}, sorted by path     |
| block_size     | int                   | bytes per entry of `block_sha256` (`BLOCK_SIZE`)             |
| profile        | object                | the card profile and its speculative defaults                |
| provenance     | object                | ignis and tool versions, input checksums, recipe             |

A module function: {name, kind ("dense", "q4_g32" or "q4_g32_tiled"), out_features, in_features, dtype
(activation dtype: "float32", "float16", "bfloat16")}. Calling convention (destination passing,
row-major): dense `name(x[W, K], w[N, K], y[W, N])`, q4_g32 `name(x[W, K], packed u32[N, K/8], scales
f16[N, K/32], y[W, N])`, q4_g32_tiled `name(x[W, K], codes u32[T, K/128, 256], scales f16[T, K/128,
64], y[W, N])` (the same q4_g32 weight re-laid by the runtime in the tiled layout of
`ignis.runtime.kernels.q4_tiled`, T = ceil(N / 16), K % 128 == 0; the container still stores q4_g32), with W
the module's width (or any rows up to W when `dynamic_rows`), N = out_features, K = in_features.
Kind `q4_g32_tiled` (route "cuda-tiled") was added within version 2: a reader that predates it
refuses it as an unknown kind (`ManifestError` naming `modules[i].functions[j]`).
A q4_g32_tiled function may serve a K that is a multiple of 32 but not of 128 (a build option,
`q4_pad_k`): it then carries the key `padded_in_features` = K rounded up to a multiple of 128, the K
it computes over; the runtime pads the tiled weight with zero columns (code 8, scale 0: they
dequantize to exactly 0) and the activations with zero columns to it, so the product equals the
unpadded one. The stored weight is not padded (the container still stores q4_g32 [N, K]). The key was
added within version 2, only on such functions: a reader that predates it refuses the manifest (an
unknown key of `modules[i].functions[j]`); manifests without padded functions are unchanged.

A kernel (`KernelEntry`): one exported function of a `files` library (role "module"), independent of
the row widths. `kind` names what it computes and `abi` the version of its calling convention; each
kind has exactly one abi a reader of this version accepts (`KERNEL_ABIS`). `dtypes` lists the input
dtypes the function takes (ascending, unique, from "bfloat16", "float16", "float32"). Kinds:

* `topk`, abi 1 (the drafter's candidate selection, `ignis.compiler.kernels.topk`; target kind
  "cuda"): `name(x[rows, V], values[rows, k], indices int64[rows, k], workspace int64[>= rows * 32 *
  ceil(V / 4096)])`, contiguous CUDA tensors, values in x's dtype; 1 <= k <= 64, 1 <= V <= 1,048,576,
  1 <= rows <= 65535; writes the top k of each row, values descending, equal values by ascending
  index, NaN above +inf, -0.0 equal to +0.0 (`torch.sort(x, -1, descending=True, stable=True)` cut to
  k); runs on the caller's CUDA stream (tvm-ffi's environment stream).
* `gdn_recurrent`, abi 1 (the fused Gated DeltaNet recurrence of a verify round,
  `ignis.compiler.kernels.gdn_recurrent`; target kind "cuda"): `name(mixed[L, n, conv_dim], b[L, n,
  Hv], a[L, n, Hv], neg_a f32[Hv], dt_bias f32[Hv], state f32[S, Hv, Dk, Dv], slots int64[L],
  record f32[>= n, >= L, Hv, Dk, Dv], out[L, n, Hv, Dv], num_key_heads: int, scale: float)`, tensors
  on one CUDA device; mixed (the conv + SiLU output, channels q (Hk * Dk) | k (Hk * Dk) | v (Hv * Dv),
  conv_dim = 2 Hk Dk + Hv Dv), b and a in one of `dtypes`, any strides; out contiguous, float32 or
  mixed's dtype. For each lane l from `state[slots[l]]` and each column t: q, k l2-normalized per key
  head (eps 1e-6, float32), q times `scale` (Dk ** -0.5), value head h reading key head h // (Hv /
  Hk); beta = sigmoid(b), g = neg_a * softplus(a + dt_bias) (threshold 20); S' = exp(g) S, delta =
  beta (v - S'^T k), S_t = S' + k delta^T, o_t = S_t^T q; writes S_t to record[t, l] and o_t to
  out[l, t]; `state` is only read. Limits: Dk <= 256, Hv a multiple of Hk = num_key_heads; wrong
  shapes, dtypes or devices raise ValueError / TypeError; allocates nothing; runs on the caller's
  CUDA stream (capturable in a CUDA graph).
* `gdn_recurrent_stash`, abi 1 (the same library as `gdn_recurrent`; target kind "cuda"): the
  `gdn_recurrent` call with `stash f32[>= n, >= L, W]` (the last dim contiguous) in place of
  `record`, W = Hk Dk + Hv Dv + 2 Hv: the same `out`, no per-column state; writes to `stash[t, l]`
  what column t of lane l fed the recurrence, float32: the normalized k of key head kh at kh Dk, v of
  value head h at Hk Dk + h Dv, beta[h] at Hk Dk + Hv Dv + h and exp(g)[h] at Hk Dk + Hv Dv + Hv + h.
* `gdn_replay`, abi 1 (the same library as `gdn_recurrent`; target kind "cuda"; `dtypes`
  ["float32"]): `name(stash f32[G, C, Ls, W], state f32[G, S, Hv, Dk, Dv], slots int64[m], keep
  int64[m], pos int64[m], num_key_heads: int)`: for every layer g and lane i, the first
  min(keep[i], C) columns of `stash[g, :, pos[i]]` (rows as `gdn_recurrent_stash` writes them) run
  the update above from `state[g, slots[i]]`, and the state after the last is written back there in
  place, equal bit for bit to what `gdn_recurrent` records after that column; keep <= 0, or a slot or
  pos out of range, leaves the lane; the slots must be distinct. One launch over every layer; the
  same checks, stream and allocation rules as `gdn_recurrent`.
* `add_rms_norm`, abi 1 (`ignis.compiler.kernels.fused_norms`; target kind "cuda"): `name(h[rows,
  D], d[rows, D], w1p f32[D], h_out[rows, D], x_out[rows, D], eps: float)`, h, d, h_out, x_out of
  one of `dtypes`, the last dim contiguous: `h_out = round(h + d)`, `x_out = round(h_out *
  rsqrt(mean(h_out^2) + eps) * w1p)` (float32 math, `round` to h's dtype; w1p = 1 + the norm weight).
* `gated_rms_norm`, abi 1 (the same library as `add_rms_norm` when both are built;
  `ignis.compiler.kernels.fused_norms`; target kind "cuda"): `name(x[rows, H, D], z[rows, H, D],
  w[D], out[rows, H * D], eps: float)`, z, w and out of one of `dtypes` (out contiguous), x float32
  or z's dtype: `out = round(round(w * round(x * rsqrt(mean(x^2) + eps))) * silu(z))` over the last
  dim. Both norms: wrong shapes or devices raise ValueError, dtypes TypeError; they allocate nothing
  and run on the caller's CUDA stream.
* `silu_mul`, abi 1 (the same library as `add_rms_norm`; `ignis.compiler.kernels.fused_norms`;
  target kind "cuda"): `name(gu[rows, 2 I], out[rows, I])`, one of `dtypes`, the last dims
  contiguous: `out = round(round(silu(gu[:, :I])) * gu[:, I:])` (float32 math, silu(v) = v / (1 +
  exp(-v)), `round` to the dtype: torch's `F.silu(gate) * up`).
* `narrow_linear`, abi 1 (the same library as `add_rms_norm`; `ignis.compiler.kernels.fused_norms`;
  target kind "cuda"): `name(x[rows, K], w[N, K], y[rows, N])`, one of `dtypes`, the last dims
  contiguous, K and the row strides of x and w multiples of 16 bytes: `y = round(x @ w^T)` (float32
  sums). Both: wrong shapes, alignments or devices raise ValueError, dtypes TypeError; they allocate
  nothing and run on the caller's CUDA stream.
* `add_rms_norm_llama`, abi 1 (the same library as `add_rms_norm`; `ignis.compiler.kernels.fused_norms`;
  target kind "cuda"): `name(h[rows, D], d[rows, D], w[D], h_out[rows, D], x_out[rows, D], eps: float)`,
  all of one of `dtypes` (w the norm weight itself, contiguous), the last dim contiguous, any row
  strides: `h_out = round(h + d)`, `x_out = round(w * round(h_out * rsqrt(mean(h_out^2) + eps)))`
  (float32 math: HF LlamaRMSNorm's two roundings). Same errors, stream and allocation rules.
* `gdn_conv_silu`, abi 1 (the GDN causal conv1d + SiLU of a verify round,
  `ignis.compiler.kernels.fused_mixers`; target kind "cuda"): `name(qkv[L * n, C], state[S, C, K -
  1], slots int64[L], weight[C, K], windows[>= L, C, >= K - 1 + n], out[L, n, C])`, qkv, state,
  weight, windows and out of one dtype from `dtypes` (any strides but out, contiguous): per lane l
  the window `[state[slots[l]] | qkv[l * n + t] for t < n]` (K - 1 + n values per channel c) is
  written to `windows[l, c, :K - 1 + n]` and `out[l, t, c] = round(silu(round(sum_k weight[c, k] *
  window[t + k])))` (float32 math, `round` to the dtype). Limits: 2 <= K <= 8, 1 <= L, n <= 65535.
* `qk_norm_rope_kv`, abi 1 (the same library as `gdn_conv_silu` when both are built;
  `ignis.compiler.kernels.fused_mixers`; target kind "cuda"): `name(q[rows, H, D], k[rows, Hkv, D],
  v[rows, Hkv, D], wq f32[D], wk f32[D], cos[rows, rot], sin[rows, rot], pos int64[rows], slots
  int64[L], kc[S, cap, Hkv, D], vc[S, cap, Hkv, D], q_out[rows, H, D], eps: float)`, rows = L * n,
  q, k, v, cos, sin, kc, vc, q_out of one dtype from `dtypes` (q_out contiguous, wq / wk contiguous;
  others any strides): per head `y = round(x * rsqrt(mean(x^2) + eps) * w1p)` (w1p = wq or wk = 1 +
  the norm weight, float32 math) then rotate-half RoPE on the first rot dims, `o = round(round(y *
  cos) + round(rotate_half(y) * sin))`; writes q's to q_out, k's to `kc[slots[r // n], pos[r]]` and
  v to `vc[slots[r // n], pos[r]]` (a row whose slot or position is out of range writes no key or
  value). Limits: rot even, rot <= D <= 1024, H + Hkv <= 65535. Both mixers: wrong shapes or devices
  raise ValueError, dtypes TypeError; they allocate nothing and run on the caller's CUDA stream
  (capturable in a CUDA graph).

* `rope_kv`, abi 1 (the same library as `gdn_conv_silu`; `ignis.compiler.kernels.fused_mixers`; target
  kind "cuda"): `name(q[rows, H, D], k[rows, Hkv, D], v[rows, Hkv, D], cos[rows, rot], sin[rows, rot],
  pos int64[rows], slots int64[L], kc[S, cap, Hkv, D], vc[S, cap, Hkv, D], q_out[rows, H, D])`:
  `qk_norm_rope_kv` without the norms (y = x), the same dtypes, strides, limits, writes and errors.
* `grouped_attention`, abi 1 (the same library as `gated_attention`; target kind "cuda"; sm_80+;
  `dtypes` bfloat16 / float16): `name(q, kc, vc, pos, slots, out, ws_o, ws_ml, max_keys: int,
  split_keys: int, scale: float)`: `gated_attention` without the gate, `out[r, h] = round(attention)`;
  out [rows, H * D] may have any even row stride >= H * D (its last dim contiguous); otherwise the
  same shapes, limits and errors.

* `gated_attention`, abi 1 (the same library as `gdn_conv_silu`; `ignis.compiler.kernels.fused_mixers`,
  `gated_attention.cuh`; target kind "cuda"; sm_80+): `name(q[rows, H, D], kc[S, cap, Hkv, D],
  vc[S, cap, Hkv, D], gate[rows, H, D], pos int64[rows], slots int64[L], out[rows, H * D],
  ws_o f32[L, Hkv, splits, r_pad, D], ws_ml f32[L, Hkv, splits, r_pad, 2], max_keys: int,
  split_keys: int, scale: float)`, rows = L * n, q, kc, vc, gate, out of one dtype from `dtypes`
  (bfloat16 / float16; q and out contiguous, the others with D contiguous): per row r of lane l
  `out[r, h] = round(round(softmax_t(q[r, h] . kc[slots[l], t, h // (H / Hkv)] * scale) vc[..]) *
  round(sigmoid(gate[r, h])))` over keys t <= pos[r], t < max_keys (fp32 sums, the probabilities
  rounded to the dtype before the value product); splits = ceil(max_keys / split_keys), split_keys a
  multiple of 32, r_pad = (H / Hkv) n rounded up to 64 (the workspace is read only when splits > 1).
  Limits: D in 32 / 64 / 128 / 256, H a multiple of Hkv; a lane whose slot is out of range gets
  zeros; wrong shapes or devices raise ValueError, dtypes TypeError; allocates nothing; runs on the
  caller's CUDA stream (capturable in a CUDA graph).

Kinds added within version 2 (`gdn_recurrent`, `add_rms_norm`, `gated_rms_norm`, `gdn_conv_silu`,
`qk_norm_rope_kv`, `gated_attention`, `gdn_recurrent_stash`, `gdn_replay`, `silu_mul`,
`narrow_linear`, `add_rms_norm_llama`, `rope_kv`, `grouped_attention`, after `topk`) are refused by a
reader that predates them (a `ManifestError` naming `kernels[i].kind`).

Widths 33..64 (8 lanes x 8 columns in one call on the tiled route) were allowed within version 2
(the h200 profile compiles every 8 rows to 64): a reader that predates it refuses such a manifest (a
`ManifestError` naming `widths`).

Versions: version 2 added `kernels`. A reader of version 2 reads version 1 manifests (no `kernels` key;
a version 1 manifest holding one is refused as an unknown key), as a manifest without kernels;
writers write version 2. Any other change to the schema is a new version.

Paths are relative POSIX paths inside the artifact directory (no `..`, no absolute paths, no
backslashes). Readers reject unknown keys, missing keys, wrong types and dangling references
(`ManifestError`), other versions (`ManifestVersionError`); `verify_artifact` checks the files
(`ArtifactFileError` for a missing, unlisted or wrongly sized file, `ArtifactChecksumError` naming
the file and the byte offset of the first corrupt block); loaders raise `ArtifactMismatchError` for
intact files that disagree with the manifest.

Depends on the standard library only (json, hashlib).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Final, TypeAlias

from .constants import FORMAT_VERSION
from .errors import FormatError

#: File name of the manifest inside an artifact directory.
MANIFEST_NAME: Final[str] = "manifest.json"

#: The `format` value of every manifest.
MANIFEST_FORMAT: Final[str] = "ignis-artifact"

#: The manifest schema version this code writes (2: `kernels` added).
MANIFEST_VERSION: Final[int] = 2

#: The widest verify row width a manifest may list (the tiled q4 kernel's 8 n-tiles).
MAX_WIDTH: Final[int] = 64

#: Every manifest schema version this code reads (a version 1 manifest has no `kernels`).
READABLE_MANIFEST_VERSIONS: Final[frozenset[int]] = frozenset({1, 2})

#: Bytes per block hash (16 MiB): a corrupt byte is located to within one block.
BLOCK_SIZE: Final[int] = 16 * 1024 * 1024

#: Largest manifest a reader accepts (64 MiB): refused before it is parsed.
MAX_MANIFEST_SIZE: Final[int] = 64 * 1024 * 1024

#: Roles a listed file may have.
FILE_ROLES: Final[frozenset[str]] = frozenset({"weights", "mtp", "module"})

#: Kinds of compiled linear functions (q4_g32_tiled: the q4_g32 weight in the runtime's tiled layout).
FUNCTION_KINDS: Final[frozenset[str]] = frozenset({"dense", "q4_g32", "q4_g32_tiled"})

#: The tiled q4 kernel's k-step: a q4_g32_tiled function's in_features not a multiple of it is padded
#: to one (`ModuleFunction.padded_in_features`).
Q4_PAD_STEP: Final[int] = 128


def padded_k(in_features: int) -> int:
    """in_features rounded up to a multiple of `Q4_PAD_STEP` (the tiled kernel's k-step)."""
    return -(-in_features // Q4_PAD_STEP) * Q4_PAD_STEP

#: Activation dtypes of compiled functions.
ACTIVATION_DTYPES: Final[frozenset[str]] = frozenset({"float32", "float16", "bfloat16"})

#: Kinds of compiled non-linear kernels (`kernels`), each with the one calling-convention version
#: (abi) a reader of this manifest version accepts, and the target kind it must be built for.
KERNEL_ABIS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "topk": 1,
        "gdn_recurrent": 1,
        "add_rms_norm": 1,
        "gated_rms_norm": 1,
        "gdn_conv_silu": 1,
        "qk_norm_rope_kv": 1,
        "gated_attention": 1,
        "gdn_recurrent_stash": 1,
        "gdn_replay": 1,
        "silu_mul": 1,
        "narrow_linear": 1,
        "moe_q4_gate_up": 1,
        "moe_q4_down": 1,
        "add_rms_norm_llama": 1,
        "rope_kv": 1,
        "grouped_attention": 1,
    }
)
KERNEL_TARGETS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "topk": "cuda",
        "gdn_recurrent": "cuda",
        "add_rms_norm": "cuda",
        "gated_rms_norm": "cuda",
        "gdn_conv_silu": "cuda",
        "qk_norm_rope_kv": "cuda",
        "gated_attention": "cuda",
        "gdn_recurrent_stash": "cuda",
        "gdn_replay": "cuda",
        "silu_mul": "cuda",
        "narrow_linear": "cuda",
        "moe_q4_gate_up": "cuda",
        "moe_q4_down": "cuda",
        "add_rms_norm_llama": "cuda",
        "rope_kv": "cuda",
        "grouped_attention": "cuda",
    }
)

# --- metadata keys of the artifact's .ninfer files (the compiler writes them, the runtime reads them) ---

#: {"name", "part" ("target" or "mtp"), "card"}.
META_ARTIFACT: Final[str] = "ignis.artifact"
#: The family (HF model_type) of the target.
META_FAMILY: Final[str] = "ignis.family"
#: The family config as a map of HF field names (`FamilyConfig.to_dict()`).
META_CONFIG: Final[str] = "ignis.config"
#: Stored dtypes of the linear weights and of every other tensor.
META_LINEAR_DTYPE: Final[str] = "ignis.linear_dtype"
META_OTHER_DTYPE: Final[str] = "ignis.other_dtype"
#: The tokenizer spec without its JSON and default template (`TokenizerSpec.to_dict()` less those).
META_TOKENIZER: Final[str] = "ignis.tokenizer"
#: The default chat template (a string).
META_CHAT_TEMPLATE: Final[str] = "ignis.chat_template"
#: The grafted DFlash2 drafter's config.json.
META_DRAFTER_CONFIG: Final[str] = "ignis.dflash2.config"
#: {"size", "vocab_size", "head", "source"} of the shortlist head.
META_SHORTLIST: Final[str] = "ignis.shortlist"
#: u8 tensor: the UTF-8 bytes of tokenizer.json.
TOKENIZER_TENSOR: Final[str] = "ignis.tokenizer.json"
#: Tensors of the shortlist head: q4_g32 [S, hidden] rows and i32 [S] token ids.
SHORTLIST_HEAD: Final[str] = "shortlist.head.weight"
SHORTLIST_IDS: Final[str] = "shortlist.token_ids"

#: A JSON value as stored in the free-form sections (profile, provenance, target, source).
JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None

_SHA256 = re.compile(r"^[0-9a-f]{64}$")

_TOP_KEYS_V1: Final[frozenset[str]] = frozenset(
    {
        "format",
        "version",
        "ninfer_version",
        "name",
        "card",
        "arch",
        "family",
        "linear_dtype",
        "other_dtype",
        "widths",
        "weights",
        "mtp",
        "tokenizer",
        "chat_template",
        "drafter",
        "shortlist",
        "modules",
        "files",
        "block_size",
        "profile",
        "provenance",
    }
)
_TOP_KEYS: Final[Mapping[int, frozenset[str]]] = MappingProxyType(
    {1: _TOP_KEYS_V1, 2: _TOP_KEYS_V1 | {"kernels"}}
)
_KERNEL_KEYS: Final[tuple[str, ...]] = ("name", "kind", "abi", "file", "target", "dtypes")


# --- errors -------------------------------------------------------------------------------------------


class ManifestError(FormatError):
    """`manifest.json` is missing, unreadable, not valid JSON, or violates the schema (a missing,
    unknown or mistyped key, a bad path, a reference to a file the manifest does not list)."""


class ManifestVersionError(ManifestError):
    """The manifest's format or version is not one this reader implements.

    Attributes:
        version: the version found (None when the `format` key itself is wrong).
    """

    def __init__(self, detail: str, *, path: str | os.PathLike[str] | None, version: object) -> None:
        super().__init__(detail, path=path)
        self.version = version


class ArtifactFileError(FormatError):
    """A file of the artifact is missing, has another size than the manifest says, or (strict check)
    the directory holds a file the manifest does not list.

    Attributes:
        problems: every problem found, one line each ("PATH: what is wrong"), in path order.
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | os.PathLike[str] | None,
        problems: list[str],
        offset: int | None = None,
    ) -> None:
        super().__init__(detail, path=path, offset=offset)
        self.problems = problems


class ArtifactChecksumError(FormatError):
    """A file's bytes do not match its sha256 in the manifest. `path` is the first corrupt file and
    `offset` the start of its first corrupt block.

    Attributes:
        mismatches: every corrupt file with the offset of its first corrupt block, in path order.
    """

    def __init__(
        self,
        detail: str,
        *,
        path: str | os.PathLike[str] | None,
        mismatches: list[tuple[str, int]],
        offset: int | None = None,
    ) -> None:
        super().__init__(detail, path=path, offset=offset)
        self.mismatches = mismatches


class ArtifactMismatchError(FormatError):
    """A file of the artifact is intact but disagrees with the manifest or with the other files (another
    family, card or dtype in its metadata, a tensor set or blob that is not what the manifest
    describes): files mixed from different artifacts, or a hand-edited manifest."""


# --- the schema -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileEntry:
    """One file of the artifact.

    Attributes:
        path: relative POSIX path inside the artifact directory.
        role: "weights" (a target .ninfer), "mtp" (the MTP companion) or "module" (compiled code).
        size: bytes.
        sha256: lowercase hex sha256 of the whole file.
        block_sha256: sha256 (hex) of each consecutive `BLOCK_SIZE`-byte block (the last may be
            shorter); empty for an empty file.
    """

    path: str
    role: str
    size: int
    sha256: str
    block_sha256: tuple[str, ...]

    def to_json(self) -> dict[str, JSONValue]:
        """The JSON object of this entry."""
        return {
            "path": self.path,
            "role": self.role,
            "size": self.size,
            "sha256": self.sha256,
            "block_sha256": list(self.block_sha256),
        }


@dataclass(frozen=True)
class ModuleFunction:
    """One compiled linear function (calling convention in the module docstring).

    Attributes:
        name: the exported symbol.
        kind: "dense", "q4_g32" or "q4_g32_tiled" (weight layout, `FUNCTION_KINDS`).
        out_features: N, rows of the weight.
        in_features: K, the reduction length (the model's: the stored weight's in_features).
        dtype: activation (and output) dtype: "float32", "float16" or "bfloat16".
        padded_in_features: (q4_g32_tiled with K % 128 != 0 only) the K the function computes over:
            K rounded up to a multiple of 128 (`padded_k`); the runtime pads the tiled weight with
            zero columns (code 8, scale 0) and the activations with zeros to it. None: K itself
            (the JSON key is then absent).
    """

    name: str
    kind: str
    out_features: int
    in_features: int
    dtype: str
    padded_in_features: int | None = None

    def to_json(self) -> dict[str, JSONValue]:
        """The JSON object of this function (``padded_in_features`` only when set)."""
        out: dict[str, JSONValue] = {
            "name": self.name,
            "kind": self.kind,
            "out_features": self.out_features,
            "in_features": self.in_features,
            "dtype": self.dtype,
        }
        if self.padded_in_features is not None:
            out["padded_in_features"] = self.padded_in_features
        return out


@dataclass(frozen=True)
class ModuleEntry:
    """A compiled module serving one verify row width (one of possibly several for that width).

    Attributes:
        width: W, the rows a call takes (the runtime pads R <= W rows up to W).
        file: the shared library (a `files` path, role "module"); several widths may share one file.
        target: the TVM target as a JSON object ({"kind": "llvm"}, {"kind": "cuda", "arch": "sm_90"}).
        route: how it was generated ("llvm-te", "cuda-tiled", "cuda-mma", "tir-dlight", ...),
            informational.
        dynamic_rows: the functions accept any row count 1..W (no padding needed).
        functions: the exported linear functions.
    """

    width: int
    file: str
    target: dict[str, JSONValue]
    route: str
    dynamic_rows: bool
    functions: tuple[ModuleFunction, ...]

    def to_json(self) -> dict[str, JSONValue]:
        """The JSON object of this module."""
        return {
            "width": self.width,
            "file": self.file,
            "target": dict(self.target),
            "route": self.route,
            "dynamic_rows": self.dynamic_rows,
            "functions": [f.to_json() for f in self.functions],
        }


@dataclass(frozen=True)
class KernelEntry:
    """A compiled non-linear function (the `kernels` list; calling conventions in the module docstring).

    Attributes:
        name: the exported symbol (a C identifier).
        kind: what it computes: a key of `KERNEL_ABIS` ("topk", "gdn_recurrent", "add_rms_norm",
            "gated_rms_norm", "gdn_conv_silu", "qk_norm_rope_kv").
        abi: the version of the kind's calling convention (`KERNEL_ABIS[kind]`).
        file: the shared library (a `files` path, role "module").
        target: the target it was built for, as a JSON object ({"kind": "cuda", "arch": "sm_90"}).
        dtypes: the input dtypes the function takes, ascending and unique (from "bfloat16",
            "float16", "float32").
    """

    name: str
    kind: str
    abi: int
    file: str
    target: dict[str, JSONValue]
    dtypes: tuple[str, ...]

    def to_json(self) -> dict[str, JSONValue]:
        """The JSON object of this kernel."""
        return {
            "name": self.name,
            "kind": self.kind,
            "abi": self.abi,
            "file": self.file,
            "target": dict(self.target),
            "dtypes": list(self.dtypes),
        }


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest (fields as in the module docstring's table)."""

    name: str
    card: str
    arch: str
    family: str
    linear_dtype: str
    other_dtype: str
    widths: tuple[int, ...]
    weights: str
    files: tuple[FileEntry, ...]
    mtp: str | None = None
    tokenizer: dict[str, JSONValue] | None = None
    chat_template: dict[str, JSONValue] | None = None
    drafter: dict[str, JSONValue] | None = None
    shortlist: dict[str, JSONValue] | None = None
    modules: tuple[ModuleEntry, ...] = ()
    kernels: tuple[KernelEntry, ...] = ()
    profile: dict[str, JSONValue] = field(default_factory=dict)
    provenance: dict[str, JSONValue] = field(default_factory=dict)
    ninfer_version: int = FORMAT_VERSION
    block_size: int = BLOCK_SIZE
    version: int = MANIFEST_VERSION

    def file(self, path: str) -> FileEntry:
        """The entry of a listed file.

        Raises:
            ManifestError: the manifest lists no such file.
        """
        for f in self.files:
            if f.path == path:
                return f
        raise ManifestError(f"the manifest lists no file {path!r}", path=None)

    def modules_for(self, width: int) -> tuple[ModuleEntry, ...]:
        """The modules compiled for exactly `width` rows (several when routes differ by shape)."""
        return tuple(m for m in self.modules if m.width == width)

    def kernel(self, kind: str, dtype: str | None = None) -> KernelEntry | None:
        """The kernel of `kind` (taking `dtype` when given), or None when the artifact has none
        (always None for a version 1 manifest)."""
        for k in self.kernels:
            if k.kind == kind and (dtype is None or dtype in k.dtypes):
                return k
        return None

    def to_json(self) -> dict[str, JSONValue]:
        """The JSON object (every key of the schema of `version`; a version 1 manifest has no
        `kernels` key, unless it holds kernels, which the reader then refuses)."""
        out: dict[str, JSONValue] = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "ninfer_version": self.ninfer_version,
            "name": self.name,
            "card": self.card,
            "arch": self.arch,
            "family": self.family,
            "linear_dtype": self.linear_dtype,
            "other_dtype": self.other_dtype,
            "widths": list(self.widths),
            "weights": self.weights,
            "mtp": self.mtp,
            "tokenizer": None if self.tokenizer is None else dict(self.tokenizer),
            "chat_template": None if self.chat_template is None else dict(self.chat_template),
            "drafter": None if self.drafter is None else dict(self.drafter),
            "shortlist": None if self.shortlist is None else dict(self.shortlist),
            "modules": [m.to_json() for m in self.modules],
            "files": [f.to_json() for f in sorted(self.files, key=lambda f: f.path)],
            "block_size": self.block_size,
            "profile": dict(self.profile),
            "provenance": dict(self.provenance),
        }
        if self.version != 1 or self.kernels:
            out["kernels"] = [k.to_json() for k in self.kernels]
        return out

    def to_bytes(self) -> bytes:
        """The canonical bytes: UTF-8 JSON, keys sorted, 2-space indent, final newline.

        Raises:
            ManifestError: the manifest does not validate (the bytes would be refused by the reader).
        """
        data = (
            json.dumps(self.to_json(), sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
        ).encode("utf-8")
        parse_manifest(data, path=None)  # never write what the reader would refuse
        return data


# --- hashing --------------------------------------------------------------------------------------------


def hash_file(
    path: str | os.PathLike[str],
    *,
    block_size: int = BLOCK_SIZE,
    progress: Callable[[int], None] | None = None,
) -> tuple[int, str, tuple[str, ...]]:
    """Size, sha256 and per-block sha256s of a file, in one streaming pass.

    Args:
        path: the file.
        block_size: bytes per block hash.
        progress: called with the number of bytes read after each chunk.

    Returns:
        (size in bytes, hex sha256 of the whole file, hex sha256 of each block).

    Raises:
        ArtifactFileError: the file cannot be read (missing, permissions).
    """
    whole = hashlib.sha256()
    blocks: list[str] = []
    size = 0
    chunk = min(block_size, 4 * 1024 * 1024)
    try:
        with open(path, "rb") as f:
            block = hashlib.sha256()
            in_block = 0
            while True:
                data = f.read(min(chunk, block_size - in_block))
                if not data:
                    break
                whole.update(data)
                block.update(data)
                in_block += len(data)
                size += len(data)
                if in_block == block_size:
                    blocks.append(block.hexdigest())
                    block = hashlib.sha256()
                    in_block = 0
                if progress is not None:
                    progress(len(data))
            if in_block:
                blocks.append(block.hexdigest())
    except OSError as exc:
        raise ArtifactFileError(
            f"cannot read the file: {exc.strerror}", path=path, problems=[f"{os.fspath(path)}: unreadable"]
        ) from exc
    return size, whole.hexdigest(), tuple(blocks)


def file_entry(
    directory: str | os.PathLike[str],
    rel_path: str,
    role: str,
    *,
    progress: Callable[[int], None] | None = None,
) -> FileEntry:
    """Hash `directory/rel_path` into a `FileEntry` (the writer's side).

    Raises:
        ManifestError: a bad relative path or role. ArtifactFileError: the file cannot be read.
    """
    _check_rel_path(rel_path, "files[].path", None)
    if role not in FILE_ROLES:
        raise ManifestError(f"file role {role!r} is not one of {sorted(FILE_ROLES)}", path=None)
    size, sha, blocks = hash_file(Path(directory) / rel_path, progress=progress)
    return FileEntry(path=rel_path, role=role, size=size, sha256=sha, block_sha256=blocks)


# --- reading and validation -----------------------------------------------------------------------------


def _fail(path: str | os.PathLike[str] | None, msg: str) -> ManifestError:
    return ManifestError(msg + "; rebuild the artifact with ignis-build", path=path)


def _check_rel_path(value: object, where: str, path: str | os.PathLike[str] | None) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(path, f"{where} must be a non-empty string, got {value!r}")
    p = PurePosixPath(value)
    if "\\" in value or p.is_absolute() or ".." in p.parts or str(p) != value or value.startswith("./"):
        raise _fail(path, f"{where} {value!r} is not a normalised relative POSIX path inside the artifact")
    return value


def _typed(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str, path: Any) -> Any:
    value = obj[key]
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, (int,)))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise _fail(path, f"{where}{key} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _int(obj: Mapping[str, Any], key: str, where: str, path: Any, *, low: int = 0) -> int:
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _fail(path, f"{where}{key} must be an integer >= {low}, got {value!r}")
    return value


def _keys(obj: object, required: Iterable[str], where: str, path: Any) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _fail(path, f"{where or 'the manifest'} must be a JSON object, got {type(obj).__name__}")
    want = set(required)
    missing = sorted(want - set(obj))
    unknown = sorted(set(obj) - want)
    if missing or unknown:
        raise _fail(
            path, f"{where or 'the manifest'} has missing key(s) {missing} and unknown key(s) {unknown}"
        )
    return obj


def _sha(value: object, where: str, path: Any) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise _fail(path, f"{where} must be 64 lowercase hex digits, got {value!r}")
    return value


def _json_object(value: object, where: str, path: Any) -> dict[str, JSONValue]:
    if not isinstance(value, dict):
        raise _fail(path, f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _optional_object(
    obj: Mapping[str, Any], key: str, required: Iterable[str], path: Any
) -> dict[str, JSONValue] | None:
    value = obj[key]
    if value is None:
        return None
    return _keys(value, required, f"{key}.", path)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_file(entry: object, i: int, block_size: int, path: Any) -> FileEntry:
    where = f"files[{i}]."
    e = _keys(entry, ("path", "role", "size", "sha256", "block_sha256"), where, path)
    rel = _check_rel_path(e["path"], where + "path", path)
    role = _typed(e, "role", str, where, path)
    if role not in FILE_ROLES:
        raise _fail(path, f"{where}role {role!r} is not one of {sorted(FILE_ROLES)}")
    size = _int(e, "size", where, path)
    sha = _sha(e["sha256"], where + "sha256", path)
    blocks = _typed(e, "block_sha256", list, where, path)
    expected = -(-size // block_size)
    if len(blocks) != expected:
        raise _fail(path, f"{where}block_sha256 has {len(blocks)} entries; a {size}-byte file has {expected}")
    for j, b in enumerate(blocks):
        _sha(b, f"{where}block_sha256[{j}]", path)
    return FileEntry(path=rel, role=role, size=size, sha256=sha, block_sha256=tuple(blocks))


def _parse_module(entry: object, i: int, path: Any) -> ModuleEntry:
    where = f"modules[{i}]."
    e = _keys(entry, ("width", "file", "target", "route", "dynamic_rows", "functions"), where, path)
    width = _int(e, "width", where, path, low=1)
    rel = _check_rel_path(e["file"], where + "file", path)
    target = _json_object(e["target"], where + "target", path)
    route = _typed(e, "route", str, where, path)
    dynamic = _typed(e, "dynamic_rows", bool, where, path)
    funcs: list[ModuleFunction] = []
    names: set[str] = set()
    for j, f in enumerate(_typed(e, "functions", list, where, path)):
        fw = f"{where}functions[{j}]."
        keys: tuple[str, ...] = ("name", "kind", "out_features", "in_features", "dtype")
        if isinstance(f, dict) and "padded_in_features" in f:
            keys = (*keys, "padded_in_features")
        fe = _keys(f, keys, fw, path)
        name = _typed(fe, "name", str, fw, path)
        if not name.isidentifier() or name in names:
            raise _fail(path, f"{fw}name {name!r} is not a C identifier or is repeated")
        names.add(name)
        kind = _typed(fe, "kind", str, fw, path)
        dtype = _typed(fe, "dtype", str, fw, path)
        if kind not in FUNCTION_KINDS or dtype not in ACTIVATION_DTYPES:
            raise _fail(
                path,
                f"{fw} kind {kind!r} / dtype {dtype!r} not in {sorted(FUNCTION_KINDS)} / "
                f"{sorted(ACTIVATION_DTYPES)}",
            )
        in_features = _int(fe, "in_features", fw, path, low=1)
        padded = _int(fe, "padded_in_features", fw, path, low=1) if "padded_in_features" in fe else None
        if kind == "q4_g32_tiled" and in_features % 32:
            raise _fail(
                path,
                f"{fw}in_features: a q4_g32_tiled function computes over whole q4 groups of 32, "
                f"got in_features {in_features} (not a multiple of 32)",
            )
        if kind == "q4_g32_tiled" and in_features % Q4_PAD_STEP:
            if padded != padded_k(in_features):
                raise _fail(
                    path,
                    f"{fw}padded_in_features: a q4_g32_tiled function of in_features {in_features} "
                    f"(a multiple of 32, not of {Q4_PAD_STEP}) must give padded_in_features "
                    f"{padded_k(in_features)}, got {padded}",
                )
        elif padded is not None:
            raise _fail(
                path,
                f"{fw}padded_in_features is only allowed on q4_g32_tiled functions whose in_features "
                f"is not a multiple of {Q4_PAD_STEP}",
            )
        funcs.append(
            ModuleFunction(
                name=name,
                kind=kind,
                out_features=_int(fe, "out_features", fw, path, low=1),
                in_features=in_features,
                dtype=dtype,
                padded_in_features=padded,
            )
        )
    return ModuleEntry(
        width=width, file=rel, target=target, route=route, dynamic_rows=dynamic, functions=tuple(funcs)
    )


def _parse_kernel(entry: object, i: int, path: Any) -> KernelEntry:
    where = f"kernels[{i}]."
    e = _keys(entry, _KERNEL_KEYS, where, path)
    name = _typed(e, "name", str, where, path)
    if not name.isidentifier():
        raise _fail(path, f"{where}name {name!r} is not a C identifier")
    kind = _typed(e, "kind", str, where, path)
    if kind not in KERNEL_ABIS:
        raise _fail(path, f"{where}kind {kind!r} is not one of {sorted(KERNEL_ABIS)}")
    abi = _int(e, "abi", where, path, low=1)
    if abi != KERNEL_ABIS[kind]:
        raise _fail(
            path,
            f"{where}abi {abi} is not the {kind} calling convention this ignis implements "
            f"({KERNEL_ABIS[kind]}); use the ignis release that built the artifact",
        )
    rel = _check_rel_path(e["file"], where + "file", path)
    target = _json_object(e["target"], where + "target", path)
    if target.get("kind") != KERNEL_TARGETS[kind]:
        raise _fail(
            path,
            f"{where}target {target!r}: a {kind} kernel is built for target kind {KERNEL_TARGETS[kind]!r}",
        )
    dtypes = _typed(e, "dtypes", list, where, path)
    if (
        not dtypes
        or not all(isinstance(d, str) and d in ACTIVATION_DTYPES for d in dtypes)
        or dtypes != sorted(set(dtypes))
    ):
        raise _fail(
            path,
            f"{where}dtypes must be a non-empty ascending list of unique dtypes from "
            f"{sorted(ACTIVATION_DTYPES)}, got {dtypes!r}",
        )
    return KernelEntry(name=name, kind=kind, abi=abi, file=rel, target=target, dtypes=tuple(dtypes))


def parse_manifest(data: bytes, *, path: str | os.PathLike[str] | None) -> Manifest:
    """Parse and validate manifest bytes.

    Args:
        data: the bytes of a `manifest.json`.
        path: the file named in error messages (None for in-memory checks).

    Returns:
        The validated `Manifest`.

    Raises:
        ManifestError: not UTF-8 JSON, a repeated key, NaN/Infinity, a missing, unknown or mistyped
            key, a bad path, duplicate files, widths not ascending and unique in 1..64, a module width
            not in `widths`, a referenced file that is not listed with the right role, a kernel of an
            unknown kind, another abi, a target of another kind, dtypes not ascending, unique and
            known, or a (kind, dtype) served twice (the message names the field: `kernels[0].abi`).
        ManifestVersionError: another `format`, or a version not in `READABLE_MANIFEST_VERSIONS`.
    """
    if len(data) > MAX_MANIFEST_SIZE:
        raise _fail(path, f"the manifest is {len(data)} bytes; the maximum is {MAX_MANIFEST_SIZE}")
    try:
        raw = json.loads(
            data.decode("utf-8"), object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(path, f"not valid UTF-8 JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise _fail(path, f"the manifest must be a JSON object, got {type(raw).__name__}")
    if raw.get("format") != MANIFEST_FORMAT:
        raise ManifestVersionError(
            f"format is {raw.get('format')!r}, not {MANIFEST_FORMAT!r}: not an ignis artifact manifest",
            path=path,
            version=None,
        )
    version = raw.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_MANIFEST_VERSIONS:
        raise ManifestVersionError(
            f"manifest version {version!r} is not supported (this ignis reads versions "
            f"{sorted(READABLE_MANIFEST_VERSIONS)}); use the ignis release that built the artifact, or "
            f"rebuild it",
            path=path,
            version=version,
        )
    m = _keys(raw, _TOP_KEYS[version], "", path)
    ninfer_version = _int(m, "ninfer_version", "", path, low=1)
    if ninfer_version != FORMAT_VERSION:
        raise ManifestVersionError(
            f"the weights are .ninfer version {ninfer_version}; this ignis reads version {FORMAT_VERSION}",
            path=path,
            version=ninfer_version,
        )
    for key in ("name", "card", "arch", "family", "linear_dtype", "other_dtype"):
        if not _typed(m, key, str, "", path):
            raise _fail(path, f"{key} must not be empty")
    widths = _typed(m, "widths", list, "", path)
    if not all(
        isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_WIDTH for w in widths
    ) or widths != sorted(set(widths)):
        raise _fail(path, f"widths must be ascending unique integers in 1..{MAX_WIDTH}, got {widths!r}")
    block_size = _int(m, "block_size", "", path, low=4096)
    files = [_parse_file(e, i, block_size, path) for i, e in enumerate(_typed(m, "files", list, "", path))]
    paths = [f.path for f in files]
    if paths != sorted(set(paths)):
        raise _fail(path, "files must be sorted by path with no path twice")
    roles = {f.path: f.role for f in files}

    def ref(value: object, where: str, role: str) -> str:
        rel = _check_rel_path(value, where, path)
        if roles.get(rel) != role:
            raise _fail(path, f"{where} names {rel!r}, which `files` does not list with role {role!r}")
        return rel

    weights = ref(m["weights"], "weights", "weights")
    mtp = None if m["mtp"] is None else ref(m["mtp"], "mtp", "mtp")
    tokenizer = _optional_object(m, "tokenizer", ("file", "tensor", "metadata_key", "sha256"), path)
    chat = _optional_object(m, "chat_template", ("file", "metadata_key", "sha256"), path)
    drafter = _optional_object(m, "drafter", ("kind", "file", "prefix", "config_key"), path)
    shortlist = _optional_object(m, "shortlist", ("file", "prefix", "size", "vocab_size", "source"), path)
    for key, obj in (
        ("tokenizer", tokenizer),
        ("chat_template", chat),
        ("drafter", drafter),
        ("shortlist", shortlist),
    ):
        if obj is not None:
            ref(obj["file"], f"{key}.file", "weights")
            for sub in ("tensor", "metadata_key", "prefix", "config_key", "kind"):
                if sub in obj:
                    _typed(obj, sub, str, f"{key}.", path)
            if "sha256" in obj:
                _sha(obj["sha256"], f"{key}.sha256", path)
    if shortlist is not None:
        size = _int(shortlist, "size", "shortlist.", path, low=1)
        vocab = _int(shortlist, "vocab_size", "shortlist.", path, low=1)
        if size > vocab:
            raise _fail(path, f"shortlist.size {size} exceeds shortlist.vocab_size {vocab}")
        _json_object(shortlist["source"], "shortlist.source", path)
    modules = [_parse_module(e, i, path) for i, e in enumerate(_typed(m, "modules", list, "", path))]
    seen_modules: set[tuple[int, str]] = set()
    seen_functions: set[tuple[int, str, int, int, str]] = set()
    for i, mod in enumerate(modules):
        ref(mod.file, f"modules[{i}].file", "module")
        if mod.width not in widths or (mod.width, mod.file) in seen_modules:
            raise _fail(
                path,
                f"modules[{i}]: width {mod.width} is not in widths {widths}, or file {mod.file!r} "
                f"is listed twice for it",
            )
        seen_modules.add((mod.width, mod.file))
        for fn in mod.functions:
            fkey = (mod.width, fn.kind, fn.out_features, fn.in_features, fn.dtype)
            if fkey in seen_functions:
                raise _fail(
                    path,
                    f"modules[{i}]: a second {fn.kind} {fn.dtype} function for "
                    f"[{fn.out_features}, {fn.in_features}] at width {mod.width}",
                )
            seen_functions.add(fkey)
    kernels: list[KernelEntry] = []
    if version >= 2:
        kernels = [_parse_kernel(e, i, path) for i, e in enumerate(_typed(m, "kernels", list, "", path))]
    seen_kernels: set[tuple[str, str]] = set()
    seen_symbols: set[tuple[str, str]] = set()
    for i, kern in enumerate(kernels):
        ref(kern.file, f"kernels[{i}].file", "module")
        if (kern.file, kern.name) in seen_symbols:
            raise _fail(path, f"kernels[{i}]: {kern.file!r} exports {kern.name!r} for a second entry")
        seen_symbols.add((kern.file, kern.name))
        for dtype in kern.dtypes:
            if (kern.kind, dtype) in seen_kernels:
                raise _fail(path, f"kernels[{i}]: a second {kern.kind} kernel for {dtype}")
            seen_kernels.add((kern.kind, dtype))
    return Manifest(
        name=m["name"],
        card=m["card"],
        arch=m["arch"],
        family=m["family"],
        linear_dtype=m["linear_dtype"],
        other_dtype=m["other_dtype"],
        widths=tuple(widths),
        weights=weights,
        files=tuple(files),
        mtp=mtp,
        tokenizer=tokenizer,
        chat_template=chat,
        drafter=drafter,
        shortlist=shortlist,
        modules=tuple(modules),
        kernels=tuple(kernels),
        profile=_json_object(m["profile"], "profile", path),
        provenance=_json_object(m["provenance"], "provenance", path),
        ninfer_version=ninfer_version,
        block_size=block_size,
        version=version,
    )


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate `directory/manifest.json`.

    Raises:
        ManifestError: the file is missing or unreadable, or does not validate (see `parse_manifest`).
        ManifestVersionError: another format, or a version this ignis does not read.
    """
    path = Path(directory) / MANIFEST_NAME
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_SIZE + 1)
    except OSError as exc:
        raise ManifestError(
            f"cannot read the manifest: {exc.strerror}; "
            f"is {os.fspath(directory)} an ignis artifact directory?",
            path=path,
        ) from exc
    return parse_manifest(data, path=path)


def _listed_files(directory: Path) -> list[str]:
    out: list[str] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for n in sorted(names):
            rel = (Path(root) / n).relative_to(directory).as_posix()
            if rel != MANIFEST_NAME:
                out.append(rel)
    return sorted(out)


def verify_artifact(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    *,
    check_hashes: bool = True,
    allow_extra: bool = False,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Check an artifact directory's files against its manifest.

    Every problem is collected before raising, so the error lists them all.

    Args:
        directory: the artifact directory.
        manifest: its parsed manifest.
        check_hashes: read every file and compare sha256 (whole file and per block); otherwise check
            presence and sizes only.
        allow_extra: accept files the manifest does not list (by default they are an error).
        progress: called with bytes read, while hashing.

    Raises:
        ArtifactFileError: a listed file is missing or has the wrong size, or an unlisted file exists
            (offset = the file's actual size for a size mismatch).
        ArtifactChecksumError: a file's bytes differ from its sha256 (`path` and `offset` name the first
            corrupt file and block; `mismatches` lists every corrupt file).
    """
    root = Path(directory)
    problems: list[str] = []
    first: tuple[Path, int | None] | None = None
    for f in manifest.files:
        p = root / f.path
        try:
            size = p.stat().st_size if p.is_file() else None
        except OSError:
            size = None
        if size is None:
            problems.append(f"{f.path}: missing (the manifest lists {f.size} bytes)")
            first = first or (p, None)
        elif size != f.size:
            problems.append(f"{f.path}: {size} bytes, the manifest says {f.size} (truncated or replaced)")
            first = first or (p, min(size, f.size))
    if not allow_extra:
        listed = {f.path for f in manifest.files}
        problems += [f"{rel}: not listed in the manifest" for rel in _listed_files(root) if rel not in listed]
        if first is None and problems:
            first = (root / problems[0].split(":", 1)[0], None)
    if problems:
        assert first is not None
        raise ArtifactFileError(
            f"{len(problems)} problem(s) with the artifact's files: " + "; ".join(problems),
            path=first[0],
            offset=first[1],
            problems=problems,
        )
    if not check_hashes:
        return
    mismatches: list[tuple[str, int]] = []
    for f in manifest.files:
        size, sha, blocks = hash_file(root / f.path, block_size=manifest.block_size, progress=progress)
        if sha != f.sha256 or blocks != f.block_sha256:
            bad = next(
                (i for i, (a, b) in enumerate(zip(blocks, f.block_sha256, strict=False)) if a != b),
                min(len(blocks), len(f.block_sha256)),
            )
            mismatches.append((f.path, bad * manifest.block_size))
    if mismatches:
        p0, off0 = mismatches[0]
        listing = "; ".join(f"{p} (first corrupt block at byte {o})" for p, o in mismatches)
        raise ArtifactChecksumError(
            f"{len(mismatches)} file(s) do not match their sha256 in the manifest: {listing}; the artifact "
            f"is corrupt: copy it again or rebuild it",
            path=root / p0,
            offset=off0,
            mismatches=mismatches,
        )


__all__ = [
    "ACTIVATION_DTYPES",
    "BLOCK_SIZE",
    "FILE_ROLES",
    "FUNCTION_KINDS",
    "KERNEL_ABIS",
    "KERNEL_TARGETS",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_VERSION",
    "MAX_WIDTH",
    "META_ARTIFACT",
    "META_CHAT_TEMPLATE",
    "META_CONFIG",
    "META_DRAFTER_CONFIG",
    "META_FAMILY",
    "META_LINEAR_DTYPE",
    "META_OTHER_DTYPE",
    "META_SHORTLIST",
    "META_TOKENIZER",
    "Q4_PAD_STEP",
    "READABLE_MANIFEST_VERSIONS",
    "SHORTLIST_HEAD",
    "SHORTLIST_IDS",
    "TOKENIZER_TENSOR",
    "ArtifactChecksumError",
    "ArtifactFileError",
    "ArtifactMismatchError",
    "FileEntry",
    "JSONValue",
    "KernelEntry",
    "Manifest",
    "ManifestError",
    "ManifestVersionError",
    "ModuleEntry",
    "ModuleFunction",
    "file_entry",
    "hash_file",
    "padded_k",
    "parse_manifest",
    "read_manifest",
    "verify_artifact",
]
