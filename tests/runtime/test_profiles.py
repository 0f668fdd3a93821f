import pytest

from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import get_profile, load_profiles


def test_every_card_of_the_build_command_has_a_profile():
    assert set(load_profiles()) == {"rtx5090", "rtxpro6000", "rtx50-16gb", "h200", "cpu"}


@pytest.mark.parametrize(
    "card,arch",
    [
        ("rtx5090", "sm_120"),
        ("rtxpro6000", "sm_120"),
        ("rtx50-16gb", "sm_120"),
        ("h200", "sm_90"),
        ("cpu", "llvm"),
    ],
)
def test_arch(card, arch):
    assert get_profile(card).arch == arch


def test_seed_defaults():
    for card in ("rtx5090", "rtxpro6000", "rtx50-16gb"):
        d = get_profile(card).spec["dflash2"]
        assert (d.backend, d.draft_tokens, d.draft_head) == ("dflash2", 7, "full")
    assert get_profile("rtx5090").spec["mtp"].backend == "off"
    m = get_profile("rtxpro6000").spec["mtp"]
    assert (m.backend, m.draft_tokens, m.draft_rows) == ("mtp", 3, 8)


def test_width_for_picks_smallest_compiled_width():
    p = get_profile("rtxpro6000")
    assert p.widths == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
    assert [p.width_for(r) for r in (1, 8, 9, 16, 17, 32, 33)] == [1, 8, 16, 16, 32, 32, None]
    h200 = get_profile("h200")  # every 8 rows to 64 on the H200, each in one tiled call
    assert h200.widths == (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64)
    assert [h200.width_for(r) for r in (17, 33, 40, 41, 57, 64, 65)] == [24, 40, 40, 48, 64, 64, None]


def test_wide_widths_are_bounded():
    from dataclasses import replace

    p = get_profile("h200")
    for bad in ((8,), (65,)):
        with pytest.raises(ConfigError, match=r"9\.\.64"):
            replace(p, wide_widths=bad)


def test_unknown_card_is_refused_with_the_known_list():
    with pytest.raises(ConfigError, match="known cards"):
        get_profile("gtx1080")


def test_every_profile_fits_the_manifest():
    """Every card profile's widths are widths a manifest may list (the build writes them there and
    re-parses what it writes: a profile wider than the reader allows fails every build at its end)."""
    from ignis.formats.manifest import MAX_WIDTH
    from ignis.runtime.profiles import load_profiles

    for profile in load_profiles().values():
        assert profile.widths and max(profile.widths) <= MAX_WIDTH, profile.name
