"""benchmarks/decode_bench.py's optimised-HLO reading: `large_concatenates` finds the weight-sized concatenates
(fused or not, any dtype, with or without a layout) and ignores activation-sized ones, so a profile can show
whether the step still copies weights (fused input projections remove the dot merger's copies)."""

from benchmarks import decode_bench

HLO = """
fused_computation.3 {
  param_0.1 = bf16[1536,1536]{1,0} parameter(0)
  param_1.2 = bf16[1536,12]{1,0} parameter(1)
  ROOT concatenate.7 = bf16[1536,1548]{1,0} concatenate(param_0.1, param_1.2), dimensions={1}
}
ENTRY main {
  %p0 = bf16[1536,2304]{1,0} parameter(0)
  %p1 = bf16[1536,1536]{1,0} parameter(1)
  %concatenate.1 = bf16[1536,3840]{1,0} concatenate(%p0, %p1), dimensions={1}, metadata={op_name="x"}
  %concatenate.2 = f32[64,3072] concatenate(%a, %b), dimensions={1}
  %small = f32[2,4]{1,0} concatenate(%c, %d), dimensions={0}
}
"""


def test_large_concatenates_counts_weight_sized_copies_only():
    got = decode_bench.large_concatenates(HLO)
    assert got["shapes"] == {"bf16[1536,1548]": 1, "bf16[1536,3840]": 1}
    assert got["count"] == 2
    assert abs(got["mb"] - 2 * 1536 * (1548 + 3840) / 1e6) < 1e-9
    assert decode_bench.large_concatenates(HLO, min_bytes=1)["count"] == 4
