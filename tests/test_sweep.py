"""scripts/sweep.py without a cluster: the search space file and its errors, the samplers, --enqueue, a study's
base, and two local workers sharing one study, one killed mid-trial and its trial taken over by the other, which
resumes it from its checkpoints (the SLURM launcher's sweep is in tests/test_slurm.py)."""

import json
import subprocess
import sys
import time

import optuna
import pytest

from train_runs import ROOT, TINY, losses, train_env

from jaxllm.cluster.sweep import load_space, make_sampler, parse_enqueue, record_base
from jaxllm.config.cli import UsageError

SPACE = '''
[params."optim.lr"]
low = 3e-4
high = 3e-2
log = true

[params."optim.warmup_steps"]
low = 0
high = 50
step = 10

[params."model.preset"]
choices = ["tiny", "small"]
'''


def test_space_file_gives_optuna_distributions(tmp_path):
    (tmp_path / "s.toml").write_text(SPACE)
    space = load_space(str(tmp_path / "s.toml"))
    assert space["optim.lr"] == optuna.distributions.FloatDistribution(3e-4, 3e-2, log=True)
    assert space["optim.warmup_steps"] == optuna.distributions.IntDistribution(0, 50, step=10)
    assert space["model.preset"] == optuna.distributions.CategoricalDistribution(["tiny", "small"])
    grid = make_sampler("grid", {k: v for k, v in space.items() if k != "optim.lr"}, seed=0)
    assert grid._search_space == {"optim.warmup_steps": [0, 10, 20, 30, 40, 50], "model.preset": ["tiny", "small"]}
    with pytest.raises(UsageError, match="params.'optim.lr' needs choices or a step"):
        make_sampler("grid", space, seed=0)
    assert parse_enqueue(["optim.lr=0.5,optim.warmup_steps=20", "model.preset=small"], space) == [
        {"optim.lr": 0.5, "optim.warmup_steps": 20}, {"model.preset": "small"}]


@pytest.mark.parametrize("text, message", [
    ('[params."optim.lr"]\nlow = 1\n', "expected low and high"),
    ('[params."optim.lr"]\nlow = 0.1\nhigh = 0.01\n', "expected numbers low < high"),
    ('[params."optim.lr"]\nlow = 0.1\nhigh = 1\nspread = 2\n', "expected low and high (and optionally log or step)"),
    ('[params."x"]\nchoices = []\n', "choices must be a non-empty list"),
    ("[other]\n", "has no [params"),
    ("params = [", "is not TOML"),
])
def test_bad_space_file_names_the_entry(tmp_path, text, message):
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(UsageError, match=r"--space: .*s\.toml") as error:
        load_space(str(tmp_path / "s.toml"))
    assert message in str(error.value)


def test_bad_enqueue_and_a_study_of_another_base_are_refused(tmp_path):
    (tmp_path / "s.toml").write_text(SPACE)
    space = load_space(str(tmp_path / "s.toml"))
    with pytest.raises(UsageError, match="optim.lr must be a number, got 'fast'"):
        parse_enqueue(["optim.lr=fast"], space)
    with pytest.raises(UsageError, match="model.preset must be one of"):
        parse_enqueue(["model.preset=huge"], space)
    with pytest.raises(UsageError, match="expected key=value pairs of the search space's keys"):
        parse_enqueue(["optim.b1=0.9"], space)
    study = optuna.create_study()
    record_base(study, "configs/pretrain.py", [("train.steps", "100")])
    record_base(study, "configs/pretrain.py", [("train.steps", "100")])  # the same base joins
    with pytest.raises(UsageError, match="this study sweeps --config configs/pretrain.py"):
        record_base(study, "configs/pretrain.py", [("train.steps", "200")])


def test_sweep_script_checks_space_keys_against_the_config(tmp_path):
    (tmp_path / "s.toml").write_text('[params."optim.lrr"]\nlow = 0.1\nhigh = 1.0\n')
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), "--config",
                           str(ROOT / "configs" / "pretrain.py"), "--space", str(tmp_path / "s.toml"), "--study",
                           str(tmp_path / "study")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: optim.lrr: unknown key"), proc.stderr
    assert not (tmp_path / "study").exists()  # nothing made


# One learning rate only, so every trial is the same run: the one taken over must end like the uninterrupted one.
# Its steps are slowed (debug.data_sleep_s) so that the kill lands mid-run; one CPU device, no mesh.
ONE_RUN = '[params."optim.lr"]\nchoices = [0.005]\n'
TRIAL = (*TINY, "--config.train.steps=8", "--config.train.eval_every=4", "--config.checkpoint.every=2",
         "--config.optim.warmup_steps=2", "--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=1",
         "--config.debug.data_sleep_s=0.4")


def test_local_workers_share_a_study_and_take_over_a_killed_workers_trial(shakespeare_store, tmp_path):
    (tmp_path / "s.toml").write_text(ONE_RUN)
    study = tmp_path / "study"
    command = [sys.executable, str(ROOT / "scripts" / "sweep.py"), "--config", str(ROOT / "configs" / "pretrain.py"),
               "--space", str(tmp_path / "s.toml"), "--study", str(study), "--trials", "2", "--cpu_devices", "1",
               "--heartbeat_s", "1", "--poll_s", "0.3", "--pruner", "none", f"--config.data.path={shakespeare_store}",
               *TRIAL]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(1))
    line = first.stdout.readline()
    assert line.startswith("trial 0 started"), (line, first.stderr.read()[-3000:])
    second = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=train_env(1))
    line = second.stdout.readline()
    assert line.startswith("trial 1 started"), (line, second.stderr.read()[-3000:])  # the same study: the next one
    taken = study / "trials" / "0001"
    deadline = time.monotonic() + 120
    while not ((taken / "metrics.jsonl").exists() and max(losses(taken), default=0) >= 3):
        assert time.monotonic() < deadline and second.poll() is None, second.stderr.read()[-3000:]
        time.sleep(0.1)
    second.kill()  # its trial's run gets SIGTERM (it saves and stops); the first worker takes the trial over
    out, err = first.communicate(timeout=180)
    assert first.returncode == 0, (out[-2000:], err[-3000:])
    assert f"trial 2 started: {{'optim.lr': 0.005}} in {taken}" in out, out
    log = (study / "trials" / "0001.log").read_text()
    stopped = int(log.split("preempted: saved step ")[1].split(",")[0])
    assert 3 <= stopped < 8 and f"resuming from checkpoint step {stopped}" in log, log[-3000:]
    trials = optuna.load_study(study_name="sweep", storage=f"sqlite:///{study / 'study.db'}").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert trials[2].user_attrs["workdir"] == str(taken)
    # Resumed from its checkpoint, the run ended as the uninterrupted trial 0 did: bitwise.
    assert losses(taken) == losses(study / "trials" / "0000")
    assert trials[2].value == trials[0].value == json.loads((taken / "summary.json").read_text())["final_eval_loss"]
