"""benchmarks/decode_kernels_bench.py on CPU (Pallas interpreter, tiny config): the read-only stream probe sums
what a float64 NumPy sum gives, the `kda` / `hbm` ops run end to end with every fused-KDA variant equal to the
first (the script's own check), and the `experts` op's plan-free kernels equal the planned path, so a GPU session
does not spend device time on a broken script."""

import jax.numpy as jnp
import numpy as np

from benchmarks import decode_kernels_bench as bench


def test_stream_probe_sums_every_weight_once():
    w = np.random.default_rng(0).standard_normal((3, 64, 96)).astype(np.float32)
    got = bench._stream_sum(jnp.asarray(w, jnp.bfloat16), tk=16, tn=32, warps=4, stages=2, interpret=True)
    want = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64).sum(axis=1)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-4)


def test_kda_and_hbm_ops_run_on_the_interpreter(capsys):
    bench.main(["--config=tiny", "--rows=4", "--backend=interpret", "--chain=1", "--iters=1", "--rotate=2",
                "--ops=hbm,kda", "--stream_tilings=16-32-2-2", "--kda_variants=32-4,16-2,32-4o"])
    out = capsys.readouterr().out
    kda_rows = [line for line in out.splitlines() if line.startswith("| kda |")]
    hbm_rows = [line for line in out.splitlines() if line.startswith("| hbm |")]
    assert len(kda_rows) == 4 and len(hbm_rows) == 6, out
    errors = [float(x.split()[0].rstrip(",")) for line in kda_rows[1:] for x in line.split("err ")[1:]]
    # state and output of 32-4 (against itself) and 16-2; only the state of the epilogue variant (its output is
    # gated and in bf16)
    assert len(errors) == 5 and all(e < 1e-6 for e in errors), kda_rows


def test_experts_op_runs_on_the_interpreter_and_matches_the_planned_path(capsys):
    from k3jax.ops import backend as backend_lib

    before = backend_lib.kernel_backend_here
    bench.main(["--config=tiny", "--rows=6", "--backend=interpret", "--chain=1", "--iters=1", "--rotate=2",
                "--ops=experts", "--experts_tilings=16-32-32-4-4-1,16-32-32-4-4-2,16-16-16-4-4-2-c"])
    assert backend_lib.kernel_backend_here is before  # the interpreter override does not leak
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| experts |")]
    assert len(rows) == 4 and "planned" in rows[0], rows
    errors = [float(line.split("err ")[1].split()[0]) for line in rows[1:]]
    assert all(e < 1e-5 for e in errors), rows


def test_glu_lhs_op_one_hot_pick_is_exact_and_the_diagnostic_is_flagged(capsys):
    bench.main(["--config=tiny", "--rows=6", "--backend=interpret", "--chain=1", "--iters=1", "--rotate=1",
                "--ops=glu_lhs"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| glu_lhs |")]
    assert len(rows) == 3 and "gather" in rows[0], rows
    by_name = {line.split("|")[4].strip(): float(line.split("err ")[1].split()[0]) for line in rows[1:]}
    assert by_name["one-hot row pick"] == 0.0, rows
    assert by_name["contiguous rows (diagnostic, wrong result)"] > 1e-3, rows  # it reads other rows by design


def test_hbm_ceiling_script_reports_bandwidth(capsys):
    from benchmarks import hbm_ceiling

    rows = hbm_ceiling.main(["--gb=0.002", "--iters=1", "--no_torch"])
    assert [r["impl"] for r in rows] == ["xla_sum", "xla_scale"]
    assert all(r["tbs"] > 0 and r["bytes"] > 0 for r in rows)
    assert "| xla_scale |" in capsys.readouterr().out
