"""Page-locked host experts (`ignis.runtime.host_pin`): what is registered, how, and the fallbacks.

CPU tests run `HostPin` against a recording stand-in for the CUDA driver (`_FakeDriver`): the
artifact's expert ranges are mapped again read-only and shared, hold the same bytes, and are
registered page-aligned, once per contiguous range, with the read-only flag; anonymous memory is
registered in place; every refusal (no read-only registration, not enough MemAvailable, a driver
error, a replaced file) undoes the registrations and hands the tensors back unchanged (mode "on":
`ConfigError`). The mode setting is validated on its own and through ModelSettings, the CLI and the
config file.

GPU (marked gpu): with the real driver the copy path of an expert cache with 1 and 2 slots is the
direct DMA (the staging ring is never allocated) and its output equals the resident model's token for
token, for in-memory experts, an artifact (its memory map) and a file on /dev/shm; with pin off the
staging ring carries every miss and the output is the same.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.formats.reader import NinferReader
from ignis.formats.writer import NinferWriter
from ignis.runtime import host_pin
from ignis.runtime.errors import ConfigError
from ignis.runtime.expert_cache import host_experts
from ignis.runtime.host_pin import PAGE, HostPin, _subtract, page_spans, parse_pin_mode
from ignis.runtime.linear import Q4Weight

E, INTER, HIDDEN = 6, 64, 256  # experts; a layer's stacks are ~150 KiB: several pages each


class _FakeDriver:
    """Records registrations; `read_only` / `fail_after` steer it."""

    read_only = 1
    fail_after: int | None = None  # registrations that succeed before one fails
    calls: ClassVar[list[tuple]] = []

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}

    def error_name(self, code: int) -> str:
        return f"CUDA_ERROR_FAKE ({code})"

    def attribute(self, attr: int, ordinal: int) -> int:
        return (
            self.read_only if attr == host_pin._CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED else 1
        )

    def has_context(self) -> bool:
        return True

    def register(self, ptr: int, size: int, flags: int) -> int:
        n = sum(1 for c in _FakeDriver.calls if c[0] == "register")
        _FakeDriver.calls.append(("register", ptr, size, flags))
        if _FakeDriver.fail_after is not None and n >= _FakeDriver.fail_after:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        self.registered[ptr] = size
        return 0

    def unregister(self, ptr: int) -> int:
        _FakeDriver.calls.append(("unregister", ptr))
        return 0 if self.registered.pop(ptr, None) is not None else 1


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type[_FakeDriver]:
    _FakeDriver.calls = []
    _FakeDriver.read_only = 1
    _FakeDriver.fail_after = None
    monkeypatch.setattr(host_pin, "_Driver", _FakeDriver)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return _FakeDriver


def _write_layer(path: Path, layers: int = 2, seed: int = 0) -> None:
    """A container with `layers` layers of fused q4 expert stacks (gate_up, down) between other tensors."""
    rng = np.random.default_rng(seed)
    with NinferWriter(path) as w:
        for i in range(layers):
            p = f"model.layers.{i}.mlp"
            w.add_tensor(f"{p}.gate.weight", rng.standard_normal((E, HIDDEN)).astype(np.float32))
            for name, (n, k) in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
                packed = rng.integers(0, 2**32, (E, n, k // 8), dtype=np.uint32)
                scales = rng.standard_normal((E, n, k // 32)).astype(np.float16)
                w.add_q4_g32(f"{p}.experts.{name}", packed, scales)
        w.finish()


def _layer_experts(reader: NinferReader, layer: int) -> list:
    """One layer's host experts as the runtime builds them (`host_experts` over the mapped stacks)."""
    p = f"model.layers.{layer}.mlp"
    weights = {
        f"{p}.experts.{n}": Q4Weight(**reader.torch_parts(f"{p}.experts.{n}"))
        for n in ("gate_up_proj", "down_proj")
    }
    config = SimpleNamespace(moe_intermediate_size=INTER, num_experts=E)
    return host_experts(config, weights, p, dtype=torch.float32)


def _leaves(experts: list) -> list[torch.Tensor]:
    return [t for w in experts for q in (w.gate, w.up, w.down) for t in (q.packed, q.scales)]


def _vma_of(ptr: int) -> str:
    """The permissions and path of the mapping holding `ptr` (/proc/self/maps)."""
    for v in host_pin._vmas():
        if v.start <= ptr < v.end:
            return f"{v.perms} {v.path}"
    return ""


# ---------------------------------------------------------------------------------------------
# settings and helpers
# ---------------------------------------------------------------------------------------------


def test_parse_pin_mode() -> None:
    assert [parse_pin_mode(v) for v in (None, "auto", " ON ", "off", True, False)] == [
        "auto", "auto", "on", "off", "on", "off",
    ]  # fmt: skip
    for bad in ("yes", "", 1, "pinned"):
        with pytest.raises(ConfigError, match="auto, on, off"):
            parse_pin_mode(bad)


def test_page_spans_and_subtract() -> None:
    assert page_spans([(10, 20), (PAGE + 5, PAGE + 6), (3 * PAGE, 3 * PAGE + 1), (0, 0)]) == [
        (0, 2 * PAGE), (3 * PAGE, 4 * PAGE),
    ]  # fmt: skip
    assert page_spans([(PAGE, 2 * PAGE), (2 * PAGE, 2 * PAGE + 1)]) == [(PAGE, 3 * PAGE)]  # touching: one
    assert _subtract([(0, 10 * PAGE)], [(2 * PAGE, 3 * PAGE), (5 * PAGE, 12 * PAGE)]) == [
        (0, 2 * PAGE), (3 * PAGE, 5 * PAGE),
    ]  # fmt: skip
    assert _subtract([(0, PAGE)], []) == [(0, PAGE)]


def test_model_settings_cli_and_config_file_take_the_mode(tmp_path: Path) -> None:
    from ignis.runtime.config_file import ConfigFileError, load_config_file
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.model import ModelSettings

    spec = SpecDefaults(backend="off")
    assert ModelSettings(spec=spec).expert_cache_pin == "auto"
    assert ModelSettings(spec=spec, expert_cache_pin="OFF").expert_cache_pin == "off"
    with pytest.raises(ConfigError, match="expert cache pin"):
        ModelSettings(spec=spec, expert_cache_pin="always")
    path = tmp_path / "c.yaml"
    for text, want in (("expert_cache_pin: off\n", "off"), ("expert_cache_pin: on\n", "on"),
                       ("expert_cache_pin: auto\n", "auto")):  # fmt: skip
        path.write_text(text)
        assert load_config_file(path).server["expert_cache_pin"] == want
    path.write_text("expert_cache_pin: sometimes\n")
    with pytest.raises(ConfigFileError, match="expert cache pin"):
        load_config_file(path)


def test_cpu_device_and_off_register_nothing(fake_cuda: type[_FakeDriver]) -> None:
    t = [torch.randn(1000)]
    for pin in (HostPin("cpu", "auto"), HostPin("cuda:0", "off")):
        assert pin.adopt(t)[0] is t[0] and not pin.on and not pin.covers(t[0])
    assert fake_cuda.calls == []
    assert "off" in HostPin("cuda:0", "off").describe()
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        HostPin("cpu", "on")


# ---------------------------------------------------------------------------------------------
# registration (the CUDA driver replaced by a recorder)
# ---------------------------------------------------------------------------------------------


def test_artifact_experts_remapped_read_only_and_registered(fake_cuda, tmp_path: Path) -> None:
    _write_layer(tmp_path / "m.ninfer")
    reader = NinferReader(tmp_path / "m.ninfer")
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    for layer in (0, 1):
        experts = _layer_experts(reader, layer)
        assert _vma_of(experts[0].gate.packed.data_ptr()).startswith("rw-p")  # the reader's private map
        adopted = pin.adopt_experts(experts)
        for before, after in zip(_leaves(experts), _leaves(adopted), strict=True):
            assert after.dtype == before.dtype and after.shape == before.shape
            assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))  # every byte
            assert after.data_ptr() != before.data_ptr() and pin.covers(after) and not pin.covers(before)
            assert _vma_of(after.data_ptr()) == f"r--s {tmp_path / 'm.ninfer'}"  # read-only, shared
    regs = [c for c in fake_cuda.calls if c[0] == "register"]
    # one registration a layer (its two stacks are adjacent in the file), page-aligned, read-only
    assert len(regs) == 2 == pin.regions
    for _, ptr, size, flags in regs:
        assert ptr % PAGE == 0 and size % PAGE == 0
        assert flags == host_pin._CU_MEMHOSTREGISTER_READ_ONLY | host_pin._CU_MEMHOSTREGISTER_PORTABLE
    layer_bytes = sum(t.numel() * t.element_size() for t in _leaves(experts))
    assert pin.pinned_bytes == 2 * layer_bytes and pin.registered_bytes >= pin.pinned_bytes
    assert "page-locked" in pin.describe() and "m.ninfer" in pin.describe()
    pin.close()
    assert sorted(c[1] for c in fake_cuda.calls if c[0] == "unregister") == sorted(r[1] for r in regs)
    assert not pin.covers(_leaves(adopted)[0])
    reader.close()


def test_anonymous_memory_copied_into_a_registered_map_of_its_own(fake_cuda) -> None:
    """Anonymous tensors come back as equal copies in one registered mapping, each page-aligned; the
    caller's own pages are never registered (their neighbours' copies would straddle a registered
    region's edge, which the driver refuses: the first H200 run failed that way)."""
    a, b = torch.randn(50_000), torch.randn(3, 7000)[:, :100]  # b: not contiguous
    neighbour = torch.randn(1000)
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    out = pin.adopt([a, b, "not a tensor"])
    assert out[0] is not a and torch.equal(out[0], a) and out[0].dtype == a.dtype
    assert out[1] is b and out[2] == "not a tensor"
    assert pin.covers(out[0]) and not pin.covers(a) and not pin.covers(b) and not pin.covers(neighbour)
    (reg,) = [c for c in fake_cuda.calls if c[0] == "register"]
    assert reg[1] == out[0].data_ptr() and reg[1] % host_pin.PAGE == 0
    assert reg[2] == -(-a.numel() * 4 // host_pin.PAGE) * host_pin.PAGE
    assert not (reg[1] <= a.data_ptr() < reg[1] + reg[2])
    assert pin.pinned_bytes == a.numel() * 4 and pin.copied_bytes == reg[2]
    # a second adoption of a view of the copy registers nothing new, and counts the bytes
    c = out[0][100:200]
    assert pin.adopt([c])[0] is c and pin.covers(c)
    assert len([x for x in fake_cuda.calls if x[0] == "register"]) == 1
    assert pin.pinned_bytes == a.numel() * 4 + 400


def test_copied_memory_is_held_until_unregistered(fake_cuda) -> None:
    """The registered copy stays mapped and registered while the pin lives, whatever the caller drops
    (freed memory could be mapped again at the same address and refused as already registered), and
    is unregistered by `close`."""
    import gc

    a = torch.randn(50_000)
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    copy = pin.adopt([a])[0]
    ptr, want = copy.data_ptr(), copy.clone()
    del copy, a
    gc.collect()
    assert [c[0] for c in fake_cuda.calls] == ["register"]
    again = pin.adopt([torch.empty(0)])  # nothing to adopt; the pin still covers its copy
    assert again[0].numel() == 0 and pin.pinned_bytes == want.numel() * 4
    view = torch.from_numpy(np.frombuffer(pin._held[0], dtype=np.float32, count=want.numel()))
    assert view.data_ptr() == ptr and torch.equal(view, want)
    del view
    pin.close()
    gc.collect()
    assert [c[0] for c in fake_cuda.calls] == ["register", "unregister"]


def test_memory_registered_by_someone_else_is_used_not_undone(fake_cuda, monkeypatch) -> None:
    a = torch.randn(50_000)
    monkeypatch.setattr(_FakeDriver, "register", lambda self, ptr, size, flags: 712)  # already registered
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    out = pin.adopt([a])[0]
    assert torch.equal(out, a) and pin.on and pin.covers(out) and pin.regions == 0
    pin.close()
    assert fake_cuda.calls == []  # nothing of ours to unregister


def test_unexpected_error_falls_back_with_its_name(fake_cuda, monkeypatch) -> None:
    def broken() -> list:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(host_pin, "_vmas", broken)
    a = torch.randn(10)
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    assert pin.adopt([a])[0] is a and not pin.on and "unexpected OSError" in pin.reason
    with pytest.raises(ConfigError, match="unexpected OSError"):
        HostPin("cuda:0", "on", margin_bytes=0).adopt([a])


def test_release_waits_out_a_cuda_graph_capture(fake_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release due while a graph is captured (a finalizer run by the collector mid-capture) must not
    synchronize: it is deferred to the next load or close."""
    a = torch.randn(50_000)
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    pin.adopt([a])
    monkeypatch.setattr(host_pin, "_capturing", lambda: True)
    pin.close()
    assert not any(c[0] == "unregister" for c in fake_cuda.calls) and host_pin._deferred
    monkeypatch.setattr(host_pin, "_capturing", lambda: False)
    HostPin("cuda:0", "auto").close()
    assert [c[0] for c in fake_cuda.calls] == ["register", "unregister"] and not host_pin._deferred


def test_no_read_only_registration_copies_into_registered_memory(fake_cuda, tmp_path: Path) -> None:
    """A device without read-only registration: the expert ranges are read into anonymous memory and
    registered writable there (never the artifact's private mapping), same bytes; the copy counts
    against the host's memory."""
    _write_layer(tmp_path / "m.ninfer")
    reader = NinferReader(tmp_path / "m.ninfer")
    fake_cuda.read_only = 0
    experts = _layer_experts(reader, 0)
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    got = pin.adopt_experts(experts)
    assert pin.on and pin.copied and "copies in anonymous memory" in pin.describe()
    for before, after in zip(_leaves(experts), _leaves(got), strict=True):
        assert torch.equal(after.view(torch.uint8), before.view(torch.uint8)) and pin.covers(after)
        assert _vma_of(after.data_ptr()) == "rw-p "  # private anonymous memory, not the file
    (reg,) = [c for c in fake_cuda.calls if c[0] == "register"]
    assert reg[3] == host_pin._CU_MEMHOSTREGISTER_PORTABLE  # writable: no READ_ONLY flag
    # the copy needs RAM even for a file on tmpfs; too little refuses (auto: back to the ring)
    short = HostPin("cuda:0", "auto", margin_bytes=1 << 60)
    assert short.adopt_experts(experts)[0].gate.packed is experts[0].gate.packed
    assert not short.on and "MemAvailable" in short.reason
    with pytest.raises(ConfigError, match=r"--expert-cache-pin on: .*MemAvailable"):
        HostPin("cuda:0", "on", margin_bytes=1 << 60).adopt_experts(experts)
    reader.close()


def test_driver_error_undoes_earlier_registrations(fake_cuda, tmp_path: Path) -> None:
    _write_layer(tmp_path / "m.ninfer")
    reader = NinferReader(tmp_path / "m.ninfer")
    fake_cuda.fail_after = 1  # layer 0 registers, layer 1 fails
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    first = pin.adopt_experts(_layer_experts(reader, 0))
    assert pin.covers(first[0].gate.packed)
    second = _layer_experts(reader, 1)
    assert pin.adopt_experts(second)[0].gate.packed is second[0].gate.packed
    assert "CUDA_ERROR_FAKE (2)" in pin.reason and "RLIMIT_MEMLOCK" in pin.reason
    registered = [c[1] for c in fake_cuda.calls if c[0] == "register"]
    assert [c[1] for c in fake_cuda.calls if c[0] == "unregister"] == registered[:1]
    assert not pin.covers(first[0].gate.packed)  # the earlier layer's views now take the staging ring
    assert torch.equal(first[0].gate.packed, _layer_experts(reader, 0)[0].gate.packed)  # and stay valid
    # later layers are not tried again
    n = len(fake_cuda.calls)
    pin.adopt_experts(_layer_experts(reader, 0))
    assert len(fake_cuda.calls) == n
    reader.close()


def test_memory_rule_refuses_disk_files_but_not_tmpfs(fake_cuda, tmp_path: Path) -> None:
    huge = 1 << 60  # no host has this much to spare
    _write_layer(tmp_path / "m.ninfer")
    reader = NinferReader(tmp_path / "m.ninfer")
    if host_pin._fs_type(str(tmp_path)) not in host_pin._MEMORY_FILESYSTEMS:
        pin = HostPin("cuda:0", "auto", margin_bytes=huge)
        experts = _layer_experts(reader, 0)
        assert pin.adopt_experts(experts)[0].down.packed is experts[0].down.packed
        assert "MemAvailable" in pin.reason
    expect = HostPin("cuda:0", "auto", margin_bytes=0)
    expect.expect(1 << 62)  # the budget's experts checked up front: refused before any layer
    assert not expect.on and "MemAvailable" in expect.reason
    reader.close()
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    shm = Path(f"/dev/shm/ignis-test-pin-{os.getpid()}.ninfer")
    try:
        _write_layer(shm)
        with NinferReader(shm) as r:
            pin = HostPin("cuda:0", "auto", margin_bytes=huge)
            experts = _layer_experts(r, 0)
            got = pin.adopt_experts(experts)
            assert pin.on and pin.covers(got[0].down.packed)  # tmpfs pages are resident already
            pin.close()
    finally:
        shm.unlink(missing_ok=True)


def test_replaced_file_falls_back(fake_cuda, tmp_path: Path) -> None:
    path = tmp_path / "m.ninfer"
    _write_layer(path)
    reader = NinferReader(path)
    experts = _layer_experts(reader, 0)
    shutil.copy(path, tmp_path / "copy")
    os.replace(tmp_path / "copy", path)  # same bytes, another inode
    pin = HostPin("cuda:0", "auto", margin_bytes=0)
    assert pin.adopt_experts(experts)[0].up.scales is experts[0].up.scales
    assert "replaced" in pin.reason
    reader.close()


# ---------------------------------------------------------------------------------------------
# GPU: the real driver
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_registers_a_mapped_file_and_copies_from_it(tmp_path: Path) -> None:
    """The real driver: the artifact-like file's experts (on disk and on /dev/shm) are registered
    read-only (torch sees them pinned) or the fallback is clean; a direct copy moves the same bytes."""
    dirs = [tmp_path] + ([Path("/dev/shm")] if os.path.isdir("/dev/shm") else [])
    for d in dirs:
        path = d / f"ignis-pin-{os.getpid()}.ninfer"
        try:
            _write_layer(path)
            with NinferReader(path) as reader:
                experts = _layer_experts(reader, 0)
                pin = HostPin("cuda", "auto")
                got = pin.adopt_experts(experts)
                if not pin.on:  # refused (e.g. no read-only registration): the tensors come back as given
                    assert pin.reason and got[0].gate.packed is experts[0].gate.packed
                    continue
                src = got[3].down.packed
                assert src.is_pinned() and pin.covers(src)
                dst = torch.empty(src.numel() * 4, dtype=torch.uint8, device="cuda")
                dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)
                torch.cuda.synchronize()
                assert torch.equal(dst.cpu(), experts[3].down.packed.reshape(-1).view(torch.uint8))
                pin.close()
                assert not src.is_pinned()
        finally:
            path.unlink(missing_ok=True)


PROMPTS = ([5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 100)), [1, 2, 3])


def _tokens(ex, drafter=None) -> list[list[int]]:
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.sampling import SamplingParams

    engine = SpeculativeEngine(ex, drafter, draft_tokens=3 if drafter is not None else None)
    outs = engine.generate(list(PROMPTS), SamplingParams(temperature=0, max_tokens=12))
    return [o.output_token_ids for o in outs]


def _assert_path(cache, pin: str) -> None:
    """Every miss took the path `pin` selects, and the other path was never used."""
    stats = cache.stats
    assert stats.misses > len(cache.layers) * cache.layers[0].num_slots  # evictions and refills
    if pin == "off":
        assert stats.staged_copies == stats.misses and stats.direct_copies == 0
        assert stats.pinned_host_bytes == 0 and cache._copier._staging
    else:
        assert stats.direct_copies == stats.misses and stats.staged_copies == 0
        assert cache._copier._staging == []  # the staging ring was never even allocated
        assert stats.pinned_host_bytes == sum(
            t.numel() * t.element_size() for lay in cache.layers for ts in lay._host_leaves for t in ts
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pin", ["on", "off"])
def test_cuda_cache_registered_path_equals_resident(pin: str, tmp_path: Path) -> None:
    """In-memory qwen3_5_moe (experts converted to bf16: anonymous memory, registered in place): 1 and 2
    slots a layer, speculation off and MTP, equal the resident executor token for token; with pin on
    every miss is a direct DMA, with pin off every miss goes through the staging ring."""
    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
    from ignis.runtime.expert_cache import ExpertCache
    from ignis.runtime.families.hybrid_executor import HybridExecutor
    from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
    from ignis.tools.make_test_drafter import make_mtp_drafter

    tiny = make_tiny_hybrid("qwen3_5_moe", tmp_path / "target")
    make_mtp_drafter(tiny.folder, tmp_path / "with_mtp", seed=7)
    config, tensors = load_mtp_checkpoint(tmp_path / "with_mtp")
    tensors = canonicalize_moe_tensors(config, tensors)
    dev, dt = torch.device("cuda"), torch.bfloat16
    ref = HybridExecutor(config, tensors, device=dev, dtype=dt)
    drafter = build_mtp_drafter(target_config=config, target_weights=tensors, device=dev, dtype=dt)
    want = _tokens(ref)
    for slots in (1, 2):
        cache = ExpertCache(slots, device=dev, pin=pin)
        ex = HybridExecutor(config, tensors, device=dev, dtype=dt, expert_cache=cache)
        assert _tokens(ex) == want
        assert _tokens(ex, drafter) == want
        _assert_path(cache, pin)
        cache.close()


@pytest.fixture(scope="module")
def next_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next artifact (cpu card: float32 experts, no compiled modules)."""
    import hf_tiny
    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.compiler.build import build_artifact

    root = tmp_path_factory.mktemp("pin_art")
    make_tiny_hybrid("qwen3_next", root / "base")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(root / "base")
    (root / "r.toml").write_text('name = "tiny-next"\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu", model=root / "base", recipe=root / "r.toml", out=root / "art",
        progress=False, echo=lambda _l: None,
    )  # fmt: skip
    assert res.out is not None
    return res.out


def test_served_cache_checks_the_host_for_the_stored_expert_bytes(
    next_artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cache_for_artifact` hands the setting to the cache and checks the artifact's stored expert bytes
    against the host's memory before any layer: too little MemAvailable falls back (auto) or refuses
    the load (on). (A CUDA device is named; nothing is allocated on it before the executor.)"""
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.expert_cache import cache_for_artifact, is_routed_expert

    with load_artifact(next_artifact) as art:
        stored = sum(art.weights.info(n).length for n in art.weights if is_routed_expert(n))
        monkeypatch.setattr(host_pin, "_meminfo", lambda: {"MemAvailable": stored, "MemTotal": stored})
        kw = dict(device=torch.device("cuda"), dtype=torch.float32, keep_q4=False, lanes=1, context=64,
                  rows=1, mtp=False)  # fmt: skip
        cache = cache_for_artifact(art, str(10**9), pin="auto", **kw)
        assert not cache.pin.on and "MemAvailable" in cache.pin.reason  # the 4 GiB margin does not fit
        with pytest.raises(ConfigError, match=r"--expert-cache-pin on: .*MemAvailable"):
            cache_for_artifact(art, str(10**9), pin="on", **kw)
        assert cache_for_artifact(art, str(10**9), pin="off", **kw).pin.reason == "--expert-cache-pin off"
        monkeypatch.setattr(host_pin, "_meminfo", lambda: {"MemAvailable": 2**40, "MemTotal": 2**40})
        assert cache_for_artifact(art, str(10**9), pin="on", **kw).pin.on


@pytest.mark.gpu
@needs_cuda
def test_cuda_artifact_memory_map_registered_path_equals_resident(next_artifact: Path) -> None:
    """A tiny qwen3_next artifact in float32 (the experts are zero-copy views of its memory map): the
    cache of 2 slots a layer with pin on maps the expert ranges read-only, registers them, copies every
    miss by DMA from them, and equals the resident executor token for token."""
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.expert_cache import ExpertCache

    with load_artifact(next_artifact) as art:
        want = _tokens(art.make_executor(device="cuda", dtype=torch.float32))
        cache = ExpertCache(2, device="cuda", pin="on")
        ex = art.make_executor(device="cuda", dtype=torch.float32, expert_cache=cache)
        files = {os.path.realpath(f) for f in cache.pin.files}
        assert files == {os.path.realpath(art.weights.path)} and cache.pin.regions >= len(cache.layers)
        assert _tokens(ex) == want
        _assert_path(cache, "on")
        assert "page-locked" in cache.describe_host()
        cache.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_pinned_memory_is_used_as_is() -> None:
    """Experts already in pinned memory (views of one pin_memory stack) are covered without a
    registration of their own."""
    stack = torch.randn(8, 4096).pin_memory()
    views = list(stack)
    pin = HostPin("cuda", "on")
    assert all(x is y for x, y in zip(pin.adopt(views), views, strict=True))
    assert pin.regions == 0 and all(pin.covers(v) for v in views)
    assert pin.pinned_bytes == stack.numel() * 4 and "page-locked" in pin.describe()


def test_copy_path_series_are_exported() -> None:
    from ignis.runtime.expert_cache import ExpertCache

    cache = ExpertCache(2, device="cpu")
    values = {name: (kind, value) for name, kind, _, value in cache.stats.samples()}
    assert values["ignis_expert_cache_direct_copies_total"] == ("counter", 0)
    assert values["ignis_expert_cache_staged_copies_total"] == ("counter", 0)
    assert values["ignis_expert_cache_pinned_host_bytes"] == ("gauge", 0)
    cache.stats.direct_copies, cache.stats.staged_copies = 5, 2
    snap = cache.stats.snapshot()
    assert (snap["direct_copies"], snap["staged_copies"], snap["pinned_host_bytes"]) == (5, 2, 0)


def test_describe_on_a_cpu_device_names_no_staging_ring() -> None:
    """Off CUDA there is no staging ring and no DMA (the slots are host tensors too): the load's line
    says the misses are plain tensor copies, as the metrics show (no direct, no staged copies)."""
    line = HostPin("cpu", "auto").describe()
    assert "plain tensor copies" in line
    assert "staging ring" not in line and "DMA" not in line, line
