"""serve.py's default XLA flags (`k3jax.inference.xla_flags`) are added only where the user set nothing, and never
after the backend started (XLA would silently ignore them)."""

import pytest

from k3jax.inference import xla_flags


def test_serving_flags_are_added_to_empty_or_unrelated_flags():
    assert xla_flags.with_serving_flags("") == " ".join(xla_flags.SERVING_XLA_FLAGS)
    got = xla_flags.with_serving_flags("--xla_force_host_platform_device_count=8")
    assert got.split() == ["--xla_force_host_platform_device_count=8", *xla_flags.SERVING_XLA_FLAGS]


def test_a_flag_the_user_set_keeps_the_users_value_and_adding_twice_changes_nothing():
    user = "--xla_gpu_graph_enable_concurrent_region=false --xla_dump_to=/tmp/x"
    assert xla_flags.with_serving_flags(user) == user
    once = xla_flags.with_serving_flags("--xla_dump_to=/tmp/x")
    assert xla_flags.with_serving_flags(once) == once


def test_apply_edits_the_given_environment_and_reports_what_it_added():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_flags.apply_serving_flags(env) == xla_flags.SERVING_XLA_FLAGS
    assert env["XLA_FLAGS"].split()[0] == "--xla_dump_to=/tmp/x"
    assert xla_flags.apply_serving_flags(env) == ()


def test_apply_refuses_once_the_backend_runs(monkeypatch):
    import jax

    jax.numpy.zeros(1).block_until_ready()  # the backend is up in this test process
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="already started"):
        xla_flags.apply_serving_flags()
