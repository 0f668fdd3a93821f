"""Speculative settings resolution (profile < config file < per-model section < command line) and the
config file's format."""

from __future__ import annotations

import pytest

from ignis.runtime.config_file import ConfigFileError, load_config_file
from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server.settings import SpecLayer, resolve_spec

CLI = "command line"


def resolve(*layers: dict, kinds: tuple[str, ...] = ("dflash2",), profile: str | None = None) -> SpecDefaults:
    return resolve_spec(
        [SpecLayer(f"layer{i}", values) for i, values in enumerate(layers)],
        spec_kinds=kinds,
        profile=profile,
        missing_backend_reason={"mtp": "no companion container", "dflash2": "no grafted drafter"},
    ).spec


RESOLVED = [
    # (layers, kinds, profile, expected)
    ((), ("dflash2",), "rtxpro6000", SpecDefaults("dflash2", 7, 0, "full")),
    ((), ("dflash2",), None, SpecDefaults("off")),
    ((), ("mtp",), "rtx5090", SpecDefaults("off")),  # Flash-Next MTP is off on a 5090
    ((), ("mtp",), "rtxpro6000", SpecDefaults("mtp", 3, 8, "full")),
    (({"backend": "mtp"},), ("mtp",), "rtx5090", SpecDefaults("mtp", 3, 0, "full")),
    (({"backend": "mtp", "draft_rows": 3},), ("mtp",), None, SpecDefaults("mtp", 3, 3, "full")),
    (({"draft_tokens": 4},), ("dflash2",), "rtxpro6000", SpecDefaults("dflash2", 4, 0, "full")),
    (({"draft_head": "shortlist"},), ("dflash2",), "rtx5090", SpecDefaults("dflash2", 7, 0, "shortlist")),
    (
        ({"backend": "dflash2", "draft_tokens": 7}, {"backend": "off"}),
        ("dflash2",),
        None,
        SpecDefaults("off"),
    ),
    (
        ({"backend": "dflash2", "draft_tokens": 7}, {}, {"backend": "off"}),
        ("dflash2",),
        None,
        SpecDefaults("off"),
    ),
    (
        ({"backend": "dflash2", "draft_tokens": 7}, {"draft_tokens": 2}),
        ("dflash2",),
        None,
        SpecDefaults("dflash2", 2, 0, "full"),
    ),
    (({"backend": False},), ("dflash2",), "rtxpro6000", SpecDefaults("off")),  # YAML's bare `off`
    (({"backend": "off"},), ("dflash2",), "rtxpro6000", SpecDefaults("off")),
    (
        ({"backend": "dflash2", "draft_tokens": 1, "draft_rows": 32},),
        ("dflash2", "mtp"),
        None,
        SpecDefaults("dflash2", 1, 32, "full"),
    ),
]


@pytest.mark.parametrize(("layers", "kinds", "profile", "want"), RESOLVED)
def test_resolution(
    layers: tuple[dict, ...], kinds: tuple[str, ...], profile: str | None, want: SpecDefaults
) -> None:
    assert resolve(*layers, kinds=kinds, profile=profile) == want


REFUSED = [
    (({"backend": "dflash2"},), ("dflash2",), None, "needs draft tokens"),
    (({"draft_tokens": 3},), ("dflash2",), None, "without a speculative backend"),
    (({"backend": "off", "draft_tokens": 3},), ("dflash2",), "rtxpro6000", "without a speculative backend"),
    (({"backend": "off"}, {"draft_tokens": 3}), ("dflash2",), None, "without a speculative backend"),
    (({"draft_tokens": 3},), ("mtp",), "rtx5090", "without a speculative backend"),
    (({"backend": "mtp"},), ("dflash2",), None, "no companion container"),
    (({"backend": "dflash2", "draft_tokens": 3},), ("mtp",), None, "no grafted drafter"),
    (({"backend": "dflash2", "draft_tokens": 3},), (), None, "no grafted drafter"),
    (({"backend": "medusa"},), ("dflash2",), None, "not one of"),
    (({"backend": "dflash2", "draft_tokens": 8},), ("dflash2",), None, "1..7"),
    (({"backend": "dflash2", "draft_tokens": 0},), ("dflash2",), None, "1..7"),
    (({"backend": "dflash2", "draft_tokens": True},), ("dflash2",), None, "1..7"),
    (({"backend": "dflash2", "draft_tokens": 3, "draft_rows": 33},), ("dflash2",), None, "0..32"),
    (({"backend": "dflash2", "draft_tokens": 3, "draft_head": "tiny"},), ("dflash2",), None, "draft_head"),
    (({"colour": "red"},), ("dflash2",), None, "unknown spec setting"),
    ((), ("dflash2",), "rtx9090", "unknown card"),
]


@pytest.mark.parametrize(("layers", "kinds", "profile", "match"), REFUSED)
def test_refusals(layers: tuple[dict, ...], kinds: tuple[str, ...], profile: str | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(*layers, kinds=kinds, profile=profile)


def test_origins_are_reported() -> None:
    r = resolve_spec(
        [SpecLayer("f.yaml spec", {"draft_tokens": 5}), SpecLayer(CLI, {"draft_head": "shortlist"})],
        spec_kinds=("dflash2",),
        profile="rtxpro6000",
    )
    assert r.origins == {
        "backend": "profile rtxpro6000",
        "draft_tokens": "f.yaml spec",
        "draft_rows": "profile rtxpro6000",
        "draft_head": CLI,
    }
    assert "shortlist" in r.describe() and "5 draft tokens" in r.describe()


# ---------------------------------------------------------------- the config file

YAML = """\
socket: /tmp/x.sock
lanes: 4
queue-size: 2
spec:
  backend: dflash2
  draft_tokens: 7
  qwen38flashnext:
    backend: off
model:
  max_context: 4096
  qwen38flashnext: {max_context: 2048}
"""

TOML = """\
socket = "/tmp/x.sock"
lanes = 4
queue_size = 2
[spec]
backend = "dflash2"
draft_tokens = 7
[spec.qwen38flashnext]
backend = "off"
[model]
max_context = 4096
[model.qwen38flashnext]
max_context = 2048
"""


@pytest.mark.parametrize(("name", "text"), [("c.yaml", YAML), ("c.toml", TOML), ("c.yml", YAML)])
def test_config_file_formats(tmp_path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    cfg = load_config_file(path)
    assert cfg.server == {"socket": "/tmp/x.sock", "lanes": 4, "queue_size": 2}
    assert cfg.spec == {"backend": "dflash2", "draft_tokens": 7}
    assert cfg.spec_models == {"qwen38flashnext": {"backend": "off"}}
    assert cfg.spec_for(["other", "qwen38flashnext"]) == {"backend": "off"}
    assert cfg.spec_for(["qwen38-27b"]) == {}
    assert cfg.max_context_for(["qwen38flashnext"]) == 2048
    assert cfg.max_context_for(["qwen38-27b"]) == 4096
    # The seeds' example: the file turns Flash-Next's MTP off alone, the 27B keeps DFlash2.
    for model, kinds, want in (("qwen38flashnext", ("mtp",), "off"), ("qwen38-27b", ("dflash2",), "dflash2")):
        layers = [SpecLayer("spec", cfg.spec), SpecLayer("spec.model", cfg.spec_for([model]))]
        assert resolve_spec(layers, spec_kinds=kinds, profile="rtxpro6000").spec.backend == want


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("c.yaml", "lanes: '8'\n", "lanes must be int"),
        ("c.yaml", "lanes: true\n", "lanes must be int"),
        ("c.yaml", "colour: red\n", "unknown key 'colour'"),
        ("c.yaml", "spec: {m: {colour: red}}\n", "unknown key spec.m.colour"),
        ("c.yaml", "spec: {draft_tokens: seven}\n", "draft_tokens must be int"),
        ("c.yaml", "spec: 3\n", "must be a mapping"),
        ("c.yaml", "model: {max_context: 1.5}\n", "max_context must be int"),
        ("c.yaml", "max_prefill_tokens: -1\n", r"c\.yaml: max_prefill_tokens must be >= 0 .*got -1"),
        ("c.toml", "max_prefill_tokens = '8'\n", "max_prefill_tokens must be int"),
        ("c.yaml", "model: {max_context: -5}\n", r"c\.yaml: model\.max_context must be >= 2, got -5"),
        ("c.toml", "[model.m]\nmax_context = 1\n", r"model\.m\.max_context must be >= 2"),
        ("c.yaml", "- a\n- b\n", "top level must be a mapping"),
        ("c.yaml", "a: [\n", "not valid YAML"),
        ("c.toml", "a = \n", "not valid TOML"),
        ("c.ini", "a=1\n", "unknown config file type"),
    ],
)
def test_config_file_errors(tmp_path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=match):
        load_config_file(path)


def test_config_file_takes_options_by_their_long_names(tmp_path) -> None:
    """`cuda-graphs` and the --spec-* options at the top level (dashes or underscores), the latter as
    the `spec` section's knobs; one knob given both ways is refused."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "cuda-graphs: false\nmax-prefill-tokens: 0\nspec_backend: dflash2\nspec-draft-tokens: 3\n"
    )
    cfg = load_config_file(path)
    assert cfg.server == {"cuda_graphs": False, "max_prefill_tokens": 0}
    assert cfg.spec == {"backend": "dflash2", "draft_tokens": 3}
    path.write_text("spec_draft_tokens: 3\nspec: {draft_tokens: 4}\n")
    with pytest.raises(ConfigFileError, match=r"spec_draft_tokens and spec\.draft_tokens both given"):
        load_config_file(path)
    path.write_text("cuda_graphs: 1\n")
    with pytest.raises(ConfigFileError, match="cuda_graphs must be bool"):
        load_config_file(path)


def test_config_file_missing(tmp_path) -> None:
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_config_file(tmp_path / "nope.yaml")
