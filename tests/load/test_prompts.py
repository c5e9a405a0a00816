"""The load's prompts: K shared ids, then ids unique per request, all in the load's id space."""

from __future__ import annotations

import pytest

from kvprobe.load.prompts import prompt_ids, unique_prompt, varying_ids
from kvprobe.load.records import TOKEN_BASE, TOKEN_RANGE


@pytest.mark.parametrize("K", [0, 1, 37, 98, 99])
def test_prompts_share_exactly_k_tokens(K):
    a = prompt_ids(100, varying_ids(0), shared_prefix_tokens=K, seed=5)
    b = prompt_ids(100, varying_ids(1), shared_prefix_tokens=K, seed=5)
    assert len(a) == len(b) == 100
    assert a[:K] == b[:K] and a[K] != b[K]
    assert all(TOKEN_BASE <= t < TOKEN_BASE + TOKEN_RANGE for t in a + b)


def test_the_prefix_belongs_to_the_probe_seed():
    assert prompt_ids(50, varying_ids(0), shared_prefix_tokens=20, seed=1)[:20] != \
        prompt_ids(50, varying_ids(0), shared_prefix_tokens=20, seed=2)[:20]


def test_without_a_prefix_the_template_is_the_previous_one():
    ids = prompt_ids(10, ("a", "b"))
    assert ids[:2] == ["a", "b"] and ids[2:] == [TOKEN_BASE + (i * 7919 + 13) % TOKEN_RANGE for i in range(2, 10)]


def test_a_prefix_as_long_as_the_prompt_is_refused():
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        prompt_ids(10, varying_ids(0), shared_prefix_tokens=10)


def test_unique_prompt_is_outside_the_loads_first_ids():
    ids = unique_prompt(20, 3)
    assert len(ids) == 20 and ids[0] < TOKEN_BASE
