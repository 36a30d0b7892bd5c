"""`lipdp train --resume`: a run killed with SIGKILL after a checkpoint resumes to the
same steps and the same final epsilon as an uninterrupted run, and its budget stops it at
the same step. Real processes (`python -m lipdp.cli`), scikit-learn's digits."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Digits, D = 64 (23 Poisson steps per epoch): the budget allows 342 steps, 14.9 of the 20
# epochs asked for, so the accountant stops the run mid-epoch.
CONFIG = {
    "dataset": {"name": "digits", "batch_size": 64, "input_bound": 4.0, "seed": 0},
    "model": {"architecture": "mlp", "widths": [32]},
    "loss": {"name": "tau_cce", "tau": 10.0},
    "optimizer": {"name": "adam", "learning_rate": 0.01},
    "privacy": {"noise_multiplier": 2.0, "epsilon_budget": 2.0},
    "training": {"epochs": 20, "private_logs_only": True},
    "certification": {"radii": [0.0, 0.1]},
}


def _lipdp(*args, **kwargs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "lipdp.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **kwargs)


def _finished(process, timeout=300):
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-4000:]
    return out


def _checkpoint_index(run_dir):
    """The path of the checkpoint state file BackupAndRestore keeps, once there is one."""
    for folder, _, files in os.walk(os.path.join(run_dir, "checkpoint")):
        if "checkpoint" in files:
            return os.path.join(folder, "checkpoint")
    return None


def _results(run_dir):
    with open(os.path.join(run_dir, "report.json")) as f:
        return json.load(f)["results"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    config = root / "digits.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    uninterrupted = str(root / "uninterrupted")
    reference = _lipdp("train", str(config), "--run-dir", uninterrupted)  # runs alongside

    killed = str(root / "killed")
    process = _lipdp("train", str(config), "--run-dir", killed)
    deadline = time.monotonic() + 240
    while _checkpoint_index(killed) is None and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    killed_state = dict(returncode=process.returncode, output=out,
                        index=_checkpoint_index(killed),
                        files=sorted(os.listdir(killed)))
    checkpoint = tf.train.latest_checkpoint(os.path.dirname(killed_state["index"]))
    reader = tf.train.load_checkpoint(checkpoint)
    killed_state["checkpoint_steps"] = int(next(
        reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
        if key.startswith("model/_dp_steps/")))
    resumed = _finished(_lipdp("train", "--resume", killed))
    _finished(reference)
    return uninterrupted, killed, killed_state, resumed


def test_the_run_was_killed_after_a_checkpoint_and_before_its_end(runs):
    _, _, state, _ = runs
    assert state["returncode"] == -signal.SIGKILL
    assert "report.json" not in state["files"] and "config.json" in state["files"]
    # The checkpoint in force is whole (it loaded above) and was written at an epoch's end.
    assert state["checkpoint_steps"] > 0 and state["checkpoint_steps"] % 23 == 0


def test_resumed_run_matches_the_uninterrupted_run(runs):
    uninterrupted, killed, state, resumed_output = runs
    expected, got = _results(uninterrupted), _results(killed)
    assert got["steps"] == expected["steps"] == 342  # the budget's stop, mid-epoch
    assert got["epsilon"] == expected["epsilon"] <= 2.0
    assert got["epochs"] == expected["epochs"] == 15
    # The resumed run's report numbers its epochs from the one it resumed at (1, 2, ... before).
    with open(os.path.join(killed, "report.json")) as f:
        numbers = json.load(f)["per_epoch"]["epoch"]
    assert numbers == list(range(state["checkpoint_steps"] // 23 + 1, 16))
    assert "resuming from it now" in resumed_output
    # The budget's plan is printed once, from the restored ledger.
    steps = state["checkpoint_steps"]
    plans = [line for line in resumed_output.splitlines() if "already taken" in line]
    assert len(plans) == 1 and f"allows 342 steps; {steps} already taken" in plans[0], plans
    assert f"{expected['steps']} steps" in resumed_output
    # The backup is deleted when the run ends; no temporary file is left in the folder.
    assert not os.path.exists(os.path.join(killed, "checkpoint"))
    assert not [name for name in os.listdir(killed) if name.startswith(".")]


def test_resume_refuses_a_finished_run_and_extra_arguments(runs, tmp_path):
    uninterrupted, _, _, _ = runs
    from lipdp import cli

    assert cli.main(["train", "--resume", uninterrupted]) == cli.EXIT_CONFIG
    assert cli.main(["train", "x.yaml", "--resume", uninterrupted]) == cli.EXIT_CONFIG
    assert cli.main(["train", "--resume", str(tmp_path)]) == cli.EXIT_DATA
