"""Which buffers are live at a compiled program's memory peak, and what keeps each of them alive.

XLA's dumps say how large the peak is (`*memory-usage-report.txt`, the allocations packed) but not why a buffer is
still live there. This reads the scheduled after-optimisation HLO of a dump and replays its schedule:

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*pure.*" python -m ...
    python benchmarks/hlo_liveness.py DIR/module_*.jit_pure.*after_optimizations.txt [--top 30]

For each computation, in schedule order, a buffer (an instruction's array output; each element of a tuple output
separately) is live from its instruction to its last consumer; a `while`, `call` or `conditional` adds the peak of
the computations it runs. Printed: the peak and where it occurs, the live buffers there by defining op, by which
consumer frees them last (with schedule positions: a buffer defined early and freed late is what a reordering
would save), and the largest ones; then the same inside the computation that holds the peak.

A model, not XLA's buffer assignment: aliases (`get-tuple-element`, `bitcast`, `tuple`, `while`, in-place
`dynamic-update-slice`) are followed, but buffers that XLA shares or updates in place inside fusions are counted
separately, and XLA's packing of the arena (fragmentation, loop state kept across a whole `while`) is not modelled,
so the peak can read high or low (`k3_gpu` at T = 131,072 on one GPU: 124.6 GiB here beside XLA's 108.4 GiB of
temporaries for one build, 89 GiB beside 137.3 for another): read which buffers are live, not the total, and take
the total from XLA's `*memory-usage-report.txt`. A `call` or `conditional` result is taken as an alias of its
operands. Parameters and constants are not counted (the arguments).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass, field

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
_ALIASES = {"get-tuple-element", "bitcast", "tuple", "while", "optimization-barrier", "opt-barrier", "call",
            "conditional", "dynamic-update-slice"}
_NOT_COUNTED = {"parameter", "constant"}


def array_bytes(text: str) -> int:
    """Bytes of every array shape in `text` (a shape or a tuple of shapes)."""
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def tuple_elements(shape: str) -> list[str]:
    """The top-level element shapes of a tuple shape string (nested tuples kept whole)."""
    inner, depth, start, out = shape.strip()[1:], 0, 0, []
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                out.append(inner[start:i])
                break
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(inner[start:i])
            start = i + 1
    return [e.strip() for e in out if e.strip()]


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    op_name: str
    called: list[str]
    index: int | None = None  # get-tuple-element's index


@dataclass
class Peak:
    bytes: int = 0
    position: int = -1
    inner: int = 0
    inner_computation: str | None = None
    live: dict = field(default_factory=dict)  # buffer -> bytes


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
    """{computation name: instructions in schedule order}, and the entry computation's name."""
    comps, entry, current, lines = {}, None, None, []
    for line in text.split("\n"):
        if current is None:
            m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
            if m and not line.startswith(" "):
                current, lines = m.group(2), []
                if m.group(1):
                    entry = current
        elif line.startswith("}"):
            comps[current] = [i for i in (_parse_instr(x) for x in lines) if i is not None]
            current = None
        else:
            lines.append(line)
    if entry is None:
        raise ValueError("no ENTRY computation: is this an HLO text dump?")
    return comps, entry


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, shape, op, rest = m.group(2), m.group(3), m.group(4), m.group(5)
    args = rest.split("), ")[0] if op != "while" else rest.split("), condition=")[0]
    operands = re.findall(r"%([\w.\-]+(?:#\d+)?)", args)
    meta = re.search(r'op_name="([^"]*)"', line)
    called = re.findall(r"(?:body|to_apply|calls)=%?([\w.\-]+)", line)
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        called += [c.strip().lstrip("%") for c in branches.group(1).split(",")]
    index = re.search(r"\bindex=(\d+)", line)
    return Instr(name, shape, op, operands, meta.group(1) if meta else "", called,
                 int(index.group(1)) if index else None)


class Liveness:
    def __init__(self, comps: dict[str, list[Instr]]):
        self.comps = comps
        self.peaks: dict[str, Peak] = {}

    def peak(self, comp: str) -> Peak:
        if comp not in self.peaks:
            self.peaks[comp] = self._peak(comp)
        return self.peaks[comp]

    def analyse(self, comp: str):
        """(instructions, by-name index, size per buffer, last use per buffer) of `comp`."""
        instrs = self.comps[comp]
        by_name = {x.name: k for k, x in enumerate(instrs)}
        roots: dict[str, set] = {}

        def owner(ref: str) -> set:
            if ref in roots:
                return roots[ref]
            if "#" in ref:  # `%fusion#k`: element k of a tuple-shaped output
                base, k = ref.split("#")
                j = by_name.get(base)
                roots[ref] = ({(base, int(k))} if j is not None and _owns_tuple(instrs[j]) else owner(base))
                return roots[ref]
            j = by_name.get(ref)
            if j is None:
                return set()
            x = instrs[j]
            if x.op in _NOT_COUNTED:
                r = set()
            elif x.op == "get-tuple-element":
                src = by_name.get(x.operands[0]) if x.operands else None
                r = ({(x.operands[0], x.index)} if src is not None and _owns_tuple(instrs[src])
                     else set().union(*(owner(o) for o in x.operands)))
            elif x.op == "dynamic-update-slice":
                r = owner(x.operands[0]) if x.operands else set()
            elif x.op in _ALIASES:
                r = set().union(*(owner(o) for o in x.operands)) if x.operands else set()
            elif x.shape.startswith("("):
                r = {(x.name, k) for k in range(len(tuple_elements(x.shape)))}
            else:
                r = {x.name}
            roots[ref] = r
            return r

        size = {}
        for x in instrs:
            if x.op in _ALIASES or x.op in _NOT_COUNTED:
                continue
            if x.shape.startswith("("):
                for k, e in enumerate(tuple_elements(x.shape)):
                    size[(x.name, k)] = array_bytes(e)
            else:
                size[x.name] = array_bytes(x.shape)
        last = {}
        for k, x in enumerate(instrs):
            for o in x.operands:
                for b in owner(o):
                    last[b] = k
        if instrs:  # the computation's result lives to its end
            for b in owner(instrs[-1].name):
                last[b] = len(instrs)
        return instrs, by_name, size, last

    def _peak(self, comp: str) -> Peak:
        instrs, by_name, size, last = self.analyse(comp)
        frees, outputs = collections.defaultdict(list), collections.defaultdict(list)
        for b in size:
            frees[last.get(b, by_name[_base(b)])].append(b)
            outputs[_base(b)].append(b)
        live, current, best = 0, {}, Peak()
        for k, x in enumerate(instrs):
            inner, inner_comp = 0, None
            if x.op in ("while", "call", "conditional"):
                for c in x.called:
                    if c in self.comps and self.peak(c).bytes > inner:
                        inner, inner_comp = self.peak(c).bytes, c
            for b in outputs[x.name]:
                current[b] = size[b]
                live += size[b]
            if live + inner > best.bytes:
                best = Peak(live + inner, k, inner, inner_comp, dict(current))
            for b in frees[k]:
                if b in current:
                    live -= current.pop(b)
        return best


def _owns_tuple(x: Instr) -> bool:
    return x.shape.startswith("(") and x.op not in _ALIASES and x.op not in _NOT_COUNTED


def _base(buffer) -> str:
    return buffer if isinstance(buffer, str) else buffer[0]


def _tail(op_name: str, parts: int = 3) -> str:
    return "/".join(op_name.split("/")[-parts:]) if op_name else "(no op_name)"


def report(live: Liveness, comp: str, top: int, out=sys.stdout, depth: int = 0) -> None:
    p = live.peak(comp)
    instrs, by_name, size, last = live.analyse(comp)
    gib = 2.0 ** 30
    if p.position < 0:
        print(f"{comp}: nothing live", file=out)
        return
    at = instrs[p.position]
    print(f"{'  ' * depth}{comp}: peak {p.bytes / gib:.2f} GiB at #{p.position} {at.name} ({at.op}); "
          f"{(p.bytes - p.inner) / gib:.2f} GiB live here + {p.inner / gib:.2f} GiB inside "
          f"{p.inner_computation or '-'}", file=out)
    by_def, by_keeper = collections.Counter(), collections.Counter()
    width = max(1, len(instrs) // 8)
    for b, n in p.live.items():
        d = instrs[by_name[_base(b)]]
        by_def[_tail(d.op_name)] += n
        u = last.get(b, by_name[_base(b)])
        keeper = _tail(instrs[u].op_name, 2) + f" ({instrs[u].op})" if u < len(instrs) else "(the result)"
        by_keeper[(by_name[_base(b)] // width * width, u // width * width, keeper)] += n
    print("  live buffers by defining op (GiB):", file=out)
    for k, n in by_def.most_common(top // 2 or 1):
        print(f"  {n / gib:8.2f}  {k}", file=out)
    print(f"  by (defined near #, freed near #, last consumer) (GiB), of {len(instrs)} instructions:", file=out)
    for (d, u, keeper), n in by_keeper.most_common(top // 2 or 1):
        print(f"  {n / gib:8.2f}  #{d:<6d} #{u:<6d} {keeper}", file=out)
    print("  largest:", file=out)
    for b, n in sorted(p.live.items(), key=lambda kv: -kv[1])[:top]:
        d = instrs[by_name[_base(b)]]
        shape = d.shape if isinstance(b, str) else tuple_elements(d.shape)[b[1]]
        print(f"  {n / gib:8.2f}  {str(b)[:44]:44s} {shape[:40]:40s} {_tail(d.op_name, 2)[-70:]}", file=out)
    if p.inner_computation and depth < 4:
        report(live, p.inner_computation, top, out, depth + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", help="an after-optimisation HLO text dump (scheduled module)")
    ap.add_argument("--top", type=int, default=24, help="rows per table")
    args = ap.parse_args(argv)
    try:
        with open(args.hlo) as f:
            comps, entry = parse(f.read())
    except (OSError, ValueError) as e:
        print(f"error: {args.hlo}: {e}", file=sys.stderr)
        return 2
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    report(Liveness(comps), entry, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
