"""Test set-up: 8 fake CPU devices, fixed before JAX initialises its backend."""
import atexit
import os
import shutil
import tempfile

from compile_flags import TEST_PROCESS_FLAGS

# Every cache a test could fill lives in one temporary directory per session, never in the real ~/.cache
# (jaxllm's CPU peak FLOP/s measurement, Hugging Face, torch, matplotlib, anything following XDG). Set before
# anything is imported, and inherited by the training subprocesses of tests/train_runs.py.
TEST_CACHE = tempfile.mkdtemp(prefix="jaxllm-test-cache-")
atexit.register(shutil.rmtree, TEST_CACHE, ignore_errors=True)
CACHE_VARIABLES = {"XDG_CACHE_HOME": "", "JAXLLM_CACHE": "jaxllm", "HF_HOME": "huggingface", "TORCH_HOME": "torch",
                   "MPLCONFIGDIR": "matplotlib"}
for _name, _sub in CACHE_VARIABLES.items():
    os.environ[_name] = os.path.join(TEST_CACHE, _sub)

# The XLA compilation cache of the training subprocesses (tests/train_runs.py), one for the whole test run: made by
# the first process to load this file (pytest's controller, or a plain run), removed by it at exit, and inherited
# by the xdist workers it starts, so a program one worker's runs compiled is read back by the other's.
XLA_CACHE_VARIABLE = "JAXLLM_TEST_XLA_CACHE"
if not os.environ.get(XLA_CACHE_VARIABLE):
    os.environ[XLA_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="jaxllm-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[XLA_CACHE_VARIABLE], ignore_errors=True)

# 8 fake devices share 2 cores: under load one device thread can reach a collective long after the others,
# so XLA's 40 s rendezvous limit is raised to 180 s (still failing fast on a real deadlock).
CPU_FLAGS = (
    "--xla_force_host_platform_device_count=8"
    " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
    " --xla_cpu_collective_call_terminate_timeout_seconds=180"
)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + CPU_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles with tests/compile_flags.py's flags (a tiny training run's compiling takes 40% of the CPU
# time it took with XLA's defaults), the test processes and every subprocess a test starts (training runs,
# scripts: they inherit XLA_FLAGS). A run's float results are the same at either optimisation level; tests that
# assert a program's exact form compile it with PRODUCTION_COMPILE. (XLA:CPU's collectives once wedged more often
# at level 0: collectives that no data path orders, taken in another order on each device; see XLA_CPU_WEDGE.)
os.environ["XLA_FLAGS"] += " " + TEST_PROCESS_FLAGS

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.devices()  # the backend starts now, with the flags above

# Parity tests compare layouts at 1e-5: keep matmuls in true float32 on CPU.
jax.config.update("jax_default_matmul_precision", "highest")
# Many queued multi-device CPU executions can deadlock XLA's CPU collectives (seen here: 150 undispatched
# train steps hung in a rendezvous). In-process tests run each computation synchronously; the training loop
# itself never has more than two steps in flight.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# XLA:CPU's runtime does not keep a loop that holds collectives in one order with the collectives beside it (no
# data path between them), so under load (2 cores, two test workers) devices can take them in different orders
# and wait for each other: XLA aborts the process at its rendezvous limit with this message (seen in 1 of 6 full
# runs on 2026-12-04, a DPO resume run, at either optimisation level). The NaN replays where it was seen now run
# their layers unrolled (jaxllm/train/diagnostic_step.py); a program of another kind could still meet it, so a
# test that failed with that message in its output runs once more from scratch (pytest-rerunfailures, only on
# this message); any other failure fails at once.
XLA_CPU_WEDGE = r"Termination timeout for `[a-z -]+ RendezvousKey"


# The test files that take longest (worker seconds in a quiet run of 2026-12-05: 160, 110, 124, 91, 81, ...;
# test_slurm.py about 125 alone on 2026-12-06) run
# first, so that the two xdist workers (`make test` passes --no-loadscope-reorder: xdist would put the files with
# the most tests first) end together on short files instead of one waiting out a long file at the end. The first
# two need different reference runs, so neither worker waits on the other's fixture lock at the start.
LONGEST_FILES = ("test_grpo_run.py", "test_checkpoint.py", "test_slurm.py", "test_preference_run.py",
                 "test_families.py", "test_multiprocess.py", "test_powersgd.py", "test_moe_models.py",
                 "test_sft_run.py", "test_drill.py", "test_ppo_run.py", "test_pipeline.py", "test_preference.py",
                 "test_lora.py", "test_watchdog.py")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[XLA_CPU_WEDGE]))
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: other files keep their order


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The directory `name`, filled by `make(directory)` once per test run. pytest-xdist runs each worker's
    session fixtures on their own, so the reference runs every worker needs would be made once per worker: the
    first worker to ask makes them under the run's shared temporary directory while the others wait on a file
    lock, then all read them (read only, as every test already treats a session fixture)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        directory = tmp_path_factory.mktemp(name)
        make(directory)
        return directory
    from filelock import FileLock

    directory = tmp_path_factory.getbasetemp().parent / name  # pytest-N/, above each worker's popen-gwK/
    made = directory.parent / f"{name}.made"
    with FileLock(str(directory.parent / f"{name}.lock")):
        if not made.exists():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that failed making it left it half made
            directory.mkdir()
            make(directory)
            made.touch()
    return directory


@pytest.fixture(scope="session")
def shakespeare_store(tmp_path_factory):
    """The shipped corpus prepared into a token store (vocab 512), once per test run (~4 s)."""
    from jaxllm.data.prepare import prepare

    def make(directory):
        prepare([str(ROOT / "data" / "shakespeare.jsonl.gz")], str(directory / "shakespeare"), vocab_size=512,
                log=lambda *a, **k: None)

    return made_once(tmp_path_factory, "data", make) / "shakespeare"


@pytest.fixture(scope="session")
def uninterrupted(shakespeare_store, tmp_path_factory):
    """The uninterrupted pretraining reference (8 tiny steps, checkpoints 4, 6, 8), one per test run, shared by
    the resume, rollback and drill tests (tests/test_checkpoint.py, tests/test_drill.py)."""
    from train_runs import resume_command, run_command

    def make(workdir):
        proc = run_command(resume_command(shakespeare_store, workdir, "--config.train.steps=8"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "uninterrupted", make)


@pytest.fixture(scope="session")
def sft_task(tmp_path_factory):
    """A slice of the shipped SFT task (every kind of example)."""
    import subprocess
    import sys

    def make(out):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_sft_task.py"), "--out", str(out)], check=True,
                       capture_output=True)
        for name, keep in (("train.jsonl", 400), ("eval.jsonl", 8)):
            lines = (out / name).read_text().splitlines()[:keep]
            (out / name).write_text("\n".join(lines) + "\n")

    return made_once(tmp_path_factory, "task", make)


@pytest.fixture(scope="session")
def bases(shakespeare_store, tmp_path_factory):
    """Two tiny pretrained runs (seeds 0 and 1): a base and a different one."""
    from train_runs import pretrain_base

    return [made_once(tmp_path_factory, f"base{seed}", lambda workdir: pretrain_base(shakespeare_store, workdir, seed))
            for seed in (0, 1)]


@pytest.fixture(scope="session")
def lora_run(bases, sft_task, tmp_path_factory):
    """6 steps of LoRA SFT on bases[0]."""
    from train_runs import run_sft

    def make(workdir):
        proc = run_sft(bases[0], sft_task, workdir, "--config.train.steps=6")
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "lora", make)


@pytest.fixture(scope="session")
def rl_prompts(tmp_path_factory, sft_task):
    """RL prompts: short prompts of the SFT task slice (one of every line whose prompt has at most 40 characters)."""
    import json

    def make(out):
        for name in ("train", "eval"):
            rows = [json.loads(x) for x in (sft_task / f"{name}.jsonl").read_text().splitlines()]
            short = [{"prompt": r["prompt"][:40]} for r in rows]
            (out / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in short) + "\n")

    return made_once(tmp_path_factory, "prompts", make)


@pytest.fixture(scope="session")
def reward_checkpoint(lora_run, tmp_path_factory):
    """A reward model of the tiny base's architecture: a random LlamaForSequenceClassification imported with
    scripts/convert_hf.py (the preference tests train real ones; here only the wiring is under test)."""
    import json
    import subprocess
    import sys

    from train_runs import ROOT, train_env

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def make(out):
        model = json.loads((lora_run / "config.json").read_text())["model"]
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=model["vocab_size"], hidden_size=model["dim"], intermediate_size=model["mlp_dim"],
            num_hidden_layers=model["num_layers"], num_attention_heads=model["num_heads"],
            num_key_value_heads=model["num_kv_heads"], head_dim=model["head_dim"], rms_norm_eps=model["norm_eps"],
            rope_theta=model["rope_theta"], num_labels=1, pad_token_id=0, tie_word_embeddings=False)
        transformers.LlamaForSequenceClassification(config).save_pretrained(out / "hf")
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_hf.py"), "import", "--hf",
                               str(out / "hf"), "--out", str(out / "ckpt")], capture_output=True, text=True,
                              env=train_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "reward_model", make) / "ckpt"


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node SLURM cluster (scripts/launch/local_slurm.sh up: installs slurm-wlm and munge if missing,
    reuses a cluster already up); its SLURM_CONF goes into this process's environment, which the clients
    (sbatch, squeue, scripts/submit.py) and the jobs inherit. Stopped at the end if this session started it. A
    cluster that cannot come up fails the tests that need it, with the reason: they never skip."""
    import subprocess

    script = ROOT / "scripts" / "launch" / "local_slurm.sh"
    proc = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        pytest.fail(f"the local SLURM cluster did not come up: {proc.stderr.strip()[-2000:]}", pytrace=False)
    setting, how = proc.stdout.strip().splitlines()[-1].split()
    os.environ["SLURM_CONF"] = setting.split("=", 1)[1]
    yield os.environ["SLURM_CONF"]
    if how == "started":
        subprocess.run(["bash", str(script), "down"], capture_output=True, timeout=120)
