"""The profile summary's critical-path split (`benchmarks/trace_summary.overlap_times`) on hand-made timelines."""

from benchmarks.trace_summary import overlap_times


def test_overlap_splits_busy_time_into_exclusive_and_shared_parts():
    # a: alone 0-4, with b 4-6, alone 6-8, with c 8-10, alone again 20-21; c alone 10-12; d alone 12-15
    events = [(0, 10, "a"), (4, 6, "b"), (8, 12, "c"), (12, 15, "d"), (20, 21, "a")]
    got = overlap_times(events)
    assert got["a"] == (11, 4 + 2 + 1, round(4 + 1 + 2 + 1 + 1), 2)  # total, exclusive, share, count
    assert got["b"] == (2, 0, 1, 1)
    assert got["c"] == (4, 2, 3, 1)
    assert got["d"] == (3, 3, 3, 1)
    busy = 15 + 1
    assert sum(share for _, _, share, _ in got.values()) == busy


def test_a_group_hidden_under_another_has_no_exclusive_time():
    got = overlap_times([(0, 100, "gemm"), (10, 20, "sort"), (30, 40, "sort")])
    assert got["sort"][1] == 0 and got["sort"][0] == 20
    assert got["gemm"][1] == 80  # 100 minus the 20 shared with the sorts


def test_idle_by_offset_bins_each_steps_gaps_from_its_start():
    from benchmarks.trace_summary import idle_by_offset

    # steps start where "head" ends (10, 110, 210); kernels a/b overlap; gaps: step 1 at 10-20 and 60-70 (offsets
    # 0 and 50), step 2 at 110-130 (offset 0) and 190-200 (offset 80, in the last bin)
    events = [(0, 10, "head"), (20, 50, "a"), (30, 60, "b"), (70, 100, "a"), (100, 110, "head"),
              (130, 190, "a"), (200, 210, "head")]
    got = idle_by_offset(events, "head", bin_ns=40, bins=2)
    assert got["steps"] == 2
    assert got["idle_ns_per_bin"] == [(10 + 20) / 2, (10 + 10) / 2]  # medians of [10, 20] and [10, 10]
    assert got["idle_ns_per_step"] == (20 + 30) / 2
    assert idle_by_offset(events[:1], "head", 40, 2)["steps"] == 0  # one anchor: no whole step
