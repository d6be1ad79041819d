"""Out-of-memory summaries (jaxllm/observe/oom.py) on a real XLA OOM message captured on this CPU, and on the
buffer-assignment listing a GPU compile adds.

tests/data/oom/cpu_init.txt is the text of the JaxRuntimeError that initialising the train state of CPU_OOM_JOB
on one CPU device raised under `ulimit -v 4000000` (jax 0.10.2, XLA:CPU; jaxllm.train.state.init_objective_state
then jax.block_until_ready): the 256 MiB it asked for is one of the stacked MLP kernels [4, 2048, 8192] in float32.
"""

import subprocess
from pathlib import Path

import pytest

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import validate
from jaxllm.observe.oom import format_oom, is_oom, parse_oom

from train_runs import train_command, train_env

ROOT = Path(__file__).resolve().parents[1]
CPU_OOM = (ROOT / "tests" / "data" / "oom" / "cpu_init.txt").read_text()
CPU_OOM_JOB = ("--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.tensor=1",
               "--config.model.vocab_size=32000", "--config.model.dim=2048", "--config.model.num_layers=4",
               "--config.model.num_heads=16", "--config.model.num_kv_heads=16", "--config.model.head_dim=128",
               "--config.model.mlp_dim=8192")

# Written here in the layout XLA's GPU compiler prints when a program's buffer assignment does not fit (the
# "BufferAssignment OOM Debugging" block), for the default 8-device job: an optimizer-state-shaped argument and
# an attention intermediate.
GPU_STYLE_OOM = """RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25769803776 bytes.
BufferAssignment OOM Debugging.
BufferAssignment stats:
             parameter allocation:   10.00MiB
              constant allocation:         0B
        maybe_live_out allocation:   10.00MiB
     preallocated temp allocation:   24.00GiB
                 total allocation:   24.02GiB
              total fragmentation:         0B (0.00%)
Peak buffers:
\tBuffer 1:
\t\tSize: 24.00GiB
\t\tOperator: op_name="jit(step)/while/body/closed_call/jvp()/while/body/closed_call/BKGTS,BSKH->BTKGH/dot_general" source_file="/x/jaxllm/model/layers.py" source_line=139
\t\tXLA Label: fusion
\t\tShape: f32[8,1,2,4096,4096]
\t\t==========================

\tBuffer 2:
\t\tSize: 256.0KiB
\t\tEntry Parameter Subshape: f32[4,128,2,64]
\t\t==========================
"""


def _cfg(*overrides, devices=1):
    return validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(list(overrides))[1]), devices)


def test_the_captured_cpu_oom_names_the_parameter_it_asked_for_and_what_to_change():
    assert is_oom(RuntimeError(CPU_OOM)) and not is_oom(RuntimeError("INTERNAL: something else"))
    assert parse_oom(CPU_OOM)["requested"] == 4 * 2048 * 8192 * 4
    text = format_oom(CPU_OOM, _cfg(*CPU_OOM_JOB))
    lines = text.splitlines()
    assert lines[0] == "error: out of device memory (XLA RESOURCE_EXHAUSTED)"
    assert "asked for: 256.00 MiB (268,435,456 bytes)" in lines[1]
    assert "available: not reported by this backend" in lines[2]
    failed = lines[lines.index("  the allocation that failed:") + 1]
    assert "layers.mlp.down_proj / layers.mlp.gate_proj / layers.mlp.up_proj" in failed
    for advice in ("mesh.fsdp", "model.remat=full (now none)", "train.batch_size (now 16)", "optim.grad_accum=2"):
        assert advice in text, advice
    assert "BufferAssignment" not in text and len(lines) < 25


def test_a_buffer_assignment_listing_maps_buffers_to_parameters_and_layer_scopes():
    facts = parse_oom(GPU_STYLE_OOM)
    assert facts["requested"] == 24 * 1024**3
    assert facts["stats"]["total"] == pytest.approx(24.02 * 1024**3, rel=1e-6)
    assert [b["size"] for b in facts["buffers"]] == [24 * 1024**3, 256 * 1024]
    cfg = _cfg("--config.model.vocab_size=512", devices=8)  # the default job: data 2, fsdp 2, tensor 2
    text = format_oom(GPU_STYLE_OOM, cfg, {"bytes_limit": 80 * 1024**3, "bytes_in_use": 70 * 1024**3})
    assert "available: 10.00 GiB of 80.00 GiB per device (70.00 GiB in use)" in text
    assert "the compiled program needs 24.02 GiB per device" in text
    # the attention intermediate by its einsum and source line; the argument by the parameter of that shape
    assert "BKGTS,BSKH->BTKGH/dot_general at /x/jaxllm/model/layers.py:139" in text
    # q_proj [L 4, D 256, N 4, H 64] split (stage, fsdp, tensor, -): [4, 128, 2, 64] on each device
    assert "256.00 KiB  parameter layers.self_attn.q_proj (or its optimizer state)" in text


# Far above what the job needs but its embedding: that allocation fails, nothing else does. Set by the shell (not a
# preexec_fn, which would fork this multithreaded JAX process).
ADDRESS_SPACE_KIB = 6 * 10**9 // 1024


def test_train_prints_the_summary_and_exits_1_on_a_real_oom(shakespeare_store, tmp_path):
    """A vocabulary of 2^26 makes the embedding and the head 16 GiB each on one device: initialising them fails
    under a 6 GB address-space limit (whatever the machine's memory), a real XLA:CPU RESOURCE_EXHAUSTED."""
    command = train_command(shakespeare_store, tmp_path, "--config.mesh.data=1", "--config.mesh.fsdp=1",
                            "--config.mesh.tensor=1", f"--config.model.vocab_size={2**26}",
                            "--config.train.batch_size=1", "--config.train.steps=2")
    limited = ["bash", "-c", f'ulimit -v {ADDRESS_SPACE_KIB} && exec "$@"', "bash", *command]
    proc = subprocess.run(limited, capture_output=True, text=True, env=train_env(devices=1), timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert err[0] == "error: out of device memory (XLA RESOURCE_EXHAUSTED)", proc.stderr[-3000:]
    assert err[1] == f"  asked for: 16.00 GiB ({2**26 * 64 * 4:,} bytes)"
    assert "parameter embed_tokens.embedding / lm_head (or its optimizer state)" in proc.stderr
    assert "Traceback" not in proc.stderr and len(err) < 25
    assert "train.batch_size" not in proc.stderr  # one row per step: nothing to split
