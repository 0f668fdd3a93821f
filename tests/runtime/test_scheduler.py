"""The row budget table and the lanes scheduler."""

import pytest

from ignis.runtime.errors import ConfigError
from ignis.runtime.scheduler import LaneScheduler, drafts_per_lane, effective_draft_rows


@pytest.mark.parametrize(
    "lanes,drafts", [(1, 3), (2, 3), (3, 1), (4, 1), (5, 0), (6, 0), (8, 0), (9, 0), (64, 0)]
)
def test_seed_table_budget_8_with_3_draft_tokens(lanes, drafts):
    """Seeds: 'a budget of 8 with 3 draft tokens gives 3 drafts at one or two active lanes, 1 at three
    or four, and none from five lanes on'."""
    assert (
        drafts_per_lane(draft_tokens=3, num_active_lanes=lanes, draft_rows=8, is_row_budgeted=True) == drafts
    )
    assert (
        drafts_per_lane(draft_tokens=3, num_active_lanes=lanes, draft_rows=0, is_row_budgeted=True) == drafts
    )


@pytest.mark.parametrize(
    "k,rows,table",
    [
        (7, 8, [7, 3, 1, 1, 0]),  # lanes 1..5
        (7, 16, [7, 7, 4, 3, 2]),
        (7, 32, [7, 7, 7, 7, 5]),
        (1, 3, [1, 0, 0, 0, 0]),  # --spec-draft-rows 3 drafts at one lane only (seeds, RTX 5090 advice)
        (3, 1, [0, 0, 0, 0, 0]),
    ],
)
def test_row_budget_formula(k, rows, table):
    got = [
        drafts_per_lane(draft_tokens=k, num_active_lanes=n, draft_rows=rows, is_row_budgeted=True)
        for n in range(1, 6)
    ]
    assert got == table
    assert got == [max(0, min(k, rows // n - 1)) for n in range(1, 6)]


def test_fixed_drafters_ignore_the_budget():
    for lanes in (1, 3, 8, 40):
        assert (
            drafts_per_lane(draft_tokens=7, num_active_lanes=lanes, draft_rows=8, is_row_budgeted=False) == 7
        )


def test_rows_never_exceed_the_budget_when_lanes_draft():
    for k in range(1, 8):
        for rows in range(1, 33):
            for lanes in range(1, 40):
                d = drafts_per_lane(
                    draft_tokens=k, num_active_lanes=lanes, draft_rows=rows, is_row_budgeted=True
                )
                assert 0 <= d <= k
                if d:
                    assert lanes * (d + 1) <= rows


@pytest.mark.parametrize("rows", [-1, 33, 8.0, True])
def test_draft_rows_out_of_range(rows):
    with pytest.raises(ConfigError, match="draft_rows"):
        effective_draft_rows(rows)
    with pytest.raises(ConfigError, match="draft_rows"):
        LaneScheduler(draft_tokens=3, draft_rows=rows)


def test_effective_rows_zero_means_eight():
    assert effective_draft_rows(0) == 8 and LaneScheduler(draft_tokens=3).row_budget == 8
    assert effective_draft_rows(32) == 32


@pytest.mark.parametrize("k", [-1, 8, 2.5])
def test_draft_tokens_out_of_range(k):
    with pytest.raises(ConfigError, match="draft_tokens"):
        LaneScheduler(draft_tokens=k)


def test_plan_caps_each_lane_and_counts_all_lanes():
    s = LaneScheduler(draft_tokens=3, draft_rows=8, is_row_budgeted=True)
    assert s.plan([]) == []
    assert s.plan([7, 7]) == [3, 3]
    assert s.plan([7, 1]) == [3, 1]  # a lane 2 tokens from max_tokens drafts 1
    assert s.plan([7, 0, -1]) == [1, 0, 0]  # three lanes: 1 draft each, capped lanes take plain rows
    assert LaneScheduler(draft_tokens=0).plan([5, 5]) == [0, 0]  # backend off


def test_admission():
    assert LaneScheduler(draft_tokens=3).num_to_admit(5, 7) == 7
    s = LaneScheduler(draft_tokens=3, max_lanes=4)
    assert [s.num_to_admit(a, 3) for a in range(6)] == [3, 3, 2, 1, 0, 0]
    with pytest.raises(ConfigError, match="max_lanes"):
        LaneScheduler(draft_tokens=3, max_lanes=0)
