"""train.py's start-up errors as a user meets them: a bad --config, --set, --mesh or --data ends with one `error:`
line on stderr and exit status 2 (no traceback), and a bad --data is found before the step is compiled; the progress
line's remaining time; the note a resume with another --steps prints; a run stopped by a signal exits 143."""

import json
import os
import signal
import subprocess
import sys

import pytest

import configs
from k3jax.training.checkpointing import schedule_change
from k3jax.training.metrics import format_duration
from k3jax.training.trainer import StoppedBySignal, TrainOptions, _format, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(*flags_: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "train.py", "--config=tiny", "--steps=1", *flags_], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


def assert_one_line_error(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], run.stderr[-2000:]


@pytest.mark.parametrize("flags_, message", [
    (["--set", "hiden_size=32"], "unknown config key(s): 'hiden_size' (did you mean 'hidden_size'?)"),
    (["--set", "hidden_size=abc"], "hidden_size needs a int, got 'abc'"),
    (["--config=tinyy"], "unknown config 'tinyy'"),
    (["--mesh=2,1"], "--mesh=2,1: mesh spec '2,1' has 2 sizes"),
    (["--mesh=a,1,1,1"], "mesh size 'a' in 'a,1,1,1' is not an integer"),
    (["--export_to=/nonexistent/ckpt"], "--export_to needs --workdir"),
    (["--mesh=64,1,1,1"], "--mesh=64,1,1,1: mesh data=64 x expert=1 x context=1 x model=1 needs 64 devices but"),
])
def test_train_py_bad_config_mesh_or_export_is_one_error_line(flags_, message):
    assert_one_line_error(run_train(*flags_), message)


def test_train_py_missing_data_fails_before_compiling(tmp_path):
    run = run_train(f"--data={tmp_path / 'nonexistent'}", "--mesh=1,1,1,1")
    assert_one_line_error(run, "is not a prepared data directory")
    assert "compiling the training step" not in run.stdout, run.stdout


def test_train_py_data_of_another_format_is_one_error_line(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"format": "something-else", "vocab_size": 259}))
    run = run_train(f"--data={tmp_path}", "--mesh=1,1,1,1")
    assert_one_line_error(run, "format 'something-else', expected 'k3jax-tokens-v1'")
    assert "compiling the training step" not in run.stdout, run.stdout


def test_progress_line_shows_the_remaining_time():
    m = {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3, "tokens_per_s": 1000.0}
    assert _format(5, m, first=False, elapsed=1.0, eta_s=185.2).endswith("ETA 3m05s")
    assert "ETA" not in _format(1, m, first=True, elapsed=1.0, eta_s=185.2)  # no step time measured yet
    assert "ETA" not in _format(30, m, first=False, elapsed=1.0, eta_s=0.0)  # the last step
    assert [format_duration(s) for s in (42, 3599.6, 7620)] == ["42s", "1h00m", "2h07m"]


def test_resume_with_other_steps_says_how_the_learning_rate_changes():
    saved = {"schedule": {"steps": 30, "learning_rate": 3e-3}}
    note = schedule_change(saved, TrainOptions(steps=40), 30)
    assert note.startswith("--steps 30 -> 40: the learning-rate schedule is recomputed; step 31 runs at lr 4.61e-04 "
                           "(the checkpoint's schedule: "), note
    assert schedule_change(saved, TrainOptions(steps=30), 30) is None
    assert "--learning_rate 0.003 -> 0.001" in schedule_change(saved, TrainOptions(steps=30, learning_rate=1e-3), 10)
    assert schedule_change({}, TrainOptions(steps=40), 30) is None  # a checkpoint that recorded no schedule


# train.py as a process whose loop is replaced by one a signal stopped (absl flags are process-global: not imported
# into the test process, where other entry points define the same flag names)
_STOPPED_RUN = """
import sys
from absl import app
import train
from k3jax.training.trainer import StoppedBySignal

def stopped(*a, **kw):
    raise StoppedBySignal("stopped by a signal after step 3 of 10: checkpoint of step 3 saved in W", [1.0], 3)

train.train = stopped
sys.argv = ["train.py", "--config=tiny", "--mesh=1,1,1,1", "--steps=10"]
app.run(train.main)
"""


def test_a_run_stopped_by_a_signal_exits_143_with_its_message():
    """train.py maps the loop's `StoppedBySignal` (a preemption before the last step) to exit status 143, so a
    scheduler restarts the job instead of counting it as finished (the loop itself: the slow test below)."""
    run = subprocess.run([sys.executable, "-c", _STOPPED_RUN], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert run.returncode == 143, run.stderr[-2000:]
    assert "stopped by a signal after step 3 of 10" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow
def test_sigterm_mid_run_saves_a_checkpoint_and_raises_stopped_by_signal(tmp_path):
    """A SIGTERM while step 1's progress line is written (after the step's save decision): the loop still saves
    step 1, stops and raises `StoppedBySignal` naming the saved step; rerunning resumes from it and finishes."""
    cfg = configs.get_config("tiny", ["num_hidden_layers=5", "full_attn_layers=(4,5)"])
    opts = TrainOptions(workdir=str(tmp_path), steps=4, batch_size=2, seq_len=32, log_every=1, checkpoint_every=0,
                        mesh="1,1,1,1")

    def log_fn(line):
        if line.startswith("step 1"):
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(StoppedBySignal, match="after step 1 of 4: checkpoint of step 1 saved in") as err:
        train(cfg, opts, log_fn=log_fn)
    assert err.value.last_saved == 1 and len(err.value.losses) == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
    assert len(train(cfg, opts, log_fn=lambda m: None)) == 3
