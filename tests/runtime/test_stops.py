"""Stop conditions checked token by token inside a committed run."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ignis.runtime.errors import StateError
from ignis.runtime.sampling import SamplingParams, SamplingParamsError
from ignis.runtime.stops import StopChecker, stop_string_holdback

PIECES = {0: "<eos>", 1: "he", 2: "llo", 3: " wor", 4: "ld", 5: "##", 6: "#", 7: "!", 8: "x"}


def detok(ids):
    return "".join(PIECES[i] for i in ids)


def checker(prompt_len=3, eos=(0,), max_context=None, **params):
    return StopChecker(
        SamplingParams(**params),
        num_prompt_tokens=prompt_len,
        eos_token_ids=eos,
        max_context=max_context,
        detokenize=detok,
    )


def test_eos_inside_a_run_cuts_it_and_is_the_last_token():
    s = checker()
    assert s.extend([1, 2, 0, 3, 4]) == 3
    assert s.output_token_ids == [1, 2, 0] and (s.finish_reason, s.stop_reason) == ("stop", None)
    with pytest.raises(StateError, match="finished"):
        s.extend([1])
    with pytest.raises(StateError, match="finished"):
        s.append(1)


def test_stop_token_ids_report_the_token_and_ignore_eos():
    s = checker(stop_token_ids=[7])
    assert s.extend([1, 7, 2]) == 2 and s.stop_reason == 7 and s.finish_reason == "stop"
    s = checker(ignore_eos=True)
    assert s.extend([1, 0, 2]) == 3 and not s.is_finished
    s = checker(ignore_eos=True, stop_token_ids=[0])  # an explicit stop id still stops
    assert s.extend([1, 0, 2]) == 2 and s.stop_reason == 0


def test_stop_string_spanning_tokens_cuts_the_text_before_it():
    s = checker(stop=["lo wo"])
    assert s.extend([1, 2]) == 2 and not s.is_finished and s.text == "hello"
    assert s.stream_text_end == len("hel")  # "lo" may start the stop string: held back
    assert s.extend([3, 4, 7]) == 1  # " wor" completes "lo wo" (spans "llo" and " wor")
    assert s.output_token_ids == [1, 2, 3] and s.text == "hel" and s.stop_reason == "lo wo"
    assert s.stream_text_end == len("hel")


def test_earliest_stop_string_wins():
    s = checker(stop=["world", "llo"])
    s.extend([1, 2, 3, 4])
    assert s.stop_reason == "llo" and s.text == "he" and s.output_token_ids == [1, 2]
    s = checker(stop=["#", "##"])  # same index: the one listed first
    s.extend([1, 5])
    assert s.stop_reason == "#" and s.text == "he"


def test_max_tokens_inside_a_run_is_never_exceeded():
    s = checker(max_tokens=4)
    assert s.num_tokens_left == 4
    assert s.extend([1, 2]) == 2 and s.num_tokens_left == 2
    assert s.extend([3, 4, 7, 8]) == 2
    assert s.output_token_ids == [1, 2, 3, 4] and s.finish_reason == "length" and s.num_tokens_left == 0


def test_context_end():
    s = checker(prompt_len=5, max_context=8, max_tokens=10)
    assert s.num_tokens_left == 3
    assert s.extend([1, 2, 3, 4]) == 3 and s.finish_reason == "length" and s.stop_reason is None
    with pytest.raises(ValueError, match="no room"):
        checker(prompt_len=8, max_context=8)


def test_stop_token_takes_precedence_over_length_on_the_same_token():
    s = checker(max_tokens=2)
    assert s.extend([1, 0]) == 2 and s.finish_reason == "stop"


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(SamplingParamsError, match="detokenize"):
        StopChecker(SamplingParams(stop=["x"]), num_prompt_tokens=1)
    s = StopChecker(SamplingParams(max_tokens=2), num_prompt_tokens=1)  # no strings: no detokenizer needed
    assert s.extend([5, 6, 7]) == 2 and s.text == ""


def test_abort():
    s = checker()
    s.extend([1])
    s.abort()
    assert s.finish_reason == "abort"
    s.abort()
    assert s.finish_reason == "abort"


@pytest.mark.parametrize(
    "text,stops,n",
    [
        ("hello", ["lo wo"], 2),
        ("hello", ["xyz"], 0),
        ("abc", ["abcd"], 3),
        ("abcd", ["abcd"], 0),
        ("aab", ["ab", "bcc"], 1),
        ("", ["a"], 0),
        ("xa", ["aa", "ab"], 1),
    ],
)
def test_holdback(text, stops, n):
    assert stop_string_holdback(text, stops) == n


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 8), min_size=1, max_size=30),
    cuts=st.lists(st.integers(1, 8), min_size=1, max_size=30),
    max_tokens=st.one_of(st.none(), st.integers(1, 30)),
    stop=st.lists(st.sampled_from(["lo", "ld!", "##", "x#", "he"]), max_size=2),
    stop_ids=st.lists(st.integers(1, 8), max_size=1),
)
def test_committed_runs_stop_exactly_where_token_by_token_decoding_stops(
    tokens, cuts, max_tokens, stop, stop_ids
):
    """However the output is cut into committed runs, the emitted tokens, text and reasons are the same."""
    params = {"max_tokens": max_tokens, "stop": stop, "stop_token_ids": stop_ids}
    one = checker(max_context=40, **params)
    for t in tokens:
        if one.append(t):
            break
    runs = checker(max_context=40, **params)
    i = 0
    for c in itertools.cycle(cuts):
        if i >= len(tokens) or runs.is_finished:
            break
        emitted = runs.extend(tokens[i : i + c])
        assert emitted == min(c, len(tokens) - i) or runs.is_finished
        i += c
    assert runs.output_token_ids == one.output_token_ids
    assert (runs.text, runs.finish_reason, runs.stop_reason) == (one.text, one.finish_reason, one.stop_reason)
    if max_tokens is not None:
        assert len(runs.output_token_ids) <= max_tokens
