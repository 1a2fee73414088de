"""benchmarks/hlo_liveness.py replays a scheduled HLO module: the peak of live bytes, where it is, what holds it."""

import io

from benchmarks.hlo_liveness import Liveness, array_bytes, main, parse, report, tuple_elements

_HLO = """HloModule m, is_scheduled=true

%inner (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %big = f32[8192]{0} broadcast(%p), dimensions={}
  %s = f32[1024]{0} slice(%big), slice={[0:1024]}
  ROOT %r = f32[1024]{0} add(%s, %p)
}

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %a = f32[1024]{0} add(%x, %x), metadata={op_name="jit(f)/add"}
  %b = f32[2048]{0} concatenate(%a, %a), dimensions={0}
  %c = f32[1024]{0} slice(%b), slice={[0:1024]}
  %t = (f32[1024]{0}, bf16[1024]{0}) fusion(%c, %a), kind=kLoop, calls=%inner
  %u = f32[1024]{0} call(%t#0), to_apply=%inner
  ROOT %e = f32[1024]{0} add(%u, %t#1)
}
"""


def test_shapes_and_tuple_elements_are_sized():
    assert array_bytes("f32[10]{0}") == 40
    assert array_bytes("(f32[10]{0}, bf16[4,4]{1,0})") == 72
    assert tuple_elements("(f32[10]{0}, bf16[4,4]{1,0}, s32[])") == ["f32[10]{0}", "bf16[4,4]{1,0}", "s32[]"]


def test_peak_follows_the_schedule_and_adds_called_computations():
    comps, entry = parse(_HLO)
    assert entry == "main" and [i.name for i in comps["main"]][:3] == ["x", "a", "b"]
    live = Liveness(comps)
    inner = live.peak("inner")  # big (32 KiB) + s (4 KiB) at s; the parameter is not counted
    assert (inner.bytes, comps["inner"][inner.position].name) == (36864, "s")
    top = live.peak("main")
    # at the call: a, b and c are freed; t's two elements (4 KiB + 2 KiB) are live, plus the called peak
    assert comps["main"][top.position].name == "u"
    assert top.inner_computation == "inner"
    assert top.bytes == 4096 + 2048 + 36864
    assert set(top.live) == {("t", 0), ("t", 1)}


def test_report_and_cli_name_the_peak(tmp_path):
    out = io.StringIO()
    comps, entry = parse(_HLO)
    report(Liveness(comps), entry, top=4, out=out)
    text = out.getvalue()
    assert "main: peak 0.00 GiB at #5 u (call)" in text and "inside inner" in text
    path = tmp_path / "m.txt"
    path.write_text(_HLO)
    assert main([str(path)]) == 0
    bad = tmp_path / "bad.txt"
    bad.write_text("not hlo")
    assert main([str(bad)]) == 2
