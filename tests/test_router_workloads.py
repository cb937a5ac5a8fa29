"""The routing chapter's workload: prefix groups with a popularity skew."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from minisrv.workloads import group_popularity, prefix_groups_workload


def test_popularity_uniform_and_hot() -> None:
    assert group_popularity(4).tolist() == [0.25] * 4
    hot = group_popularity(5, hot_share=0.6)
    assert hot[0] == 0.6 and np.allclose(hot[1:], 0.1) and hot.sum() == pytest.approx(1)
    assert group_popularity(1, 1.0).tolist() == [1.0]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="hot_share must be in"):
            group_popularity(3, bad)
    with pytest.raises(ValueError, match="n_groups"):
        group_popularity(0)


def test_prompts_are_a_group_prefix_plus_a_question() -> None:
    wl = prefix_groups_workload(n=400, n_groups=4, prefix_len=30, question_range=(2, 5),
                                hot_share=0.7, rate=10.0, seed=1)
    heads = Counter(tuple(p[:30]) for p in wl.prompts)
    assert len(heads) == 4
    assert max(heads.values()) / 400 == pytest.approx(0.7, abs=0.06)
    assert all(32 <= len(p) <= 35 for p in wl.prompts)
    assert len({tuple(p) for p in wl.prompts}) == 400  # questions make every prompt distinct
    assert wl.arrivals == sorted(wl.arrivals) and wl.arrivals[0] == 0.0
    again = prefix_groups_workload(n=400, n_groups=4, prefix_len=30, question_range=(2, 5),
                                   hot_share=0.7, rate=10.0, seed=1)
    assert again.prompts == wl.prompts and again.output_lens == wl.output_lens
    with pytest.raises(ValueError, match="question_range"):
        prefix_groups_workload(n=3, question_range=(0, 4))
