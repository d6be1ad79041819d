"""The compiled train step updates its donated state in place: XLA copies no parameter or optimizer moment on
entry. A copy of the whole state (params and both Adam moments) cost the data-parallel step about a tenth of its
time on CPU (scripts/bench_step.py, bare vs plain); the anomaly skip's selects brought it in once."""

import re
import sys

import pytest

from train_runs import ROOT

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import validate
from jaxllm.observe.hlo_text import HloModule, array_shapes

sys.path.insert(0, str(ROOT / "scripts"))
from bench_step import prepared_step  # noqa: E402

SMALL = ("--config.model.num_layers=2", "--config.model.dim=64", "--config.model.num_heads=4",
         "--config.model.num_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.model.vocab_size=256", "--config.train.seq_len=32", "--config.train.batch_size=8")


def _entry_copies_of_arguments(hlo_text: str) -> list[str]:
    """The entry computation's copies of its (array, not scalar) arguments, as printed."""
    module = HloModule.parse(hlo_text)
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.M).group(1)
    instructions = [i for i in module.instructions if i.computation == entry]
    arguments = {i.name for i in instructions if i.opcode == "parameter"
                 if any(len(dims) >= 2 for _, dims in array_shapes(i.shape))}
    return [i.text.strip()[:120] for i in instructions
            if i.opcode == "copy" and re.search(r"copy\(%?([\w.\-]+)\)", i.text).group(1) in arguments]


@pytest.mark.parametrize("mesh, on_anomaly", [((8, 1, 1), "rollback"), ((2, 2, 2), "skip"), ((8, 1, 1), "abort")],
                         ids=["data8-rollback", "2x2x2-skip", "data8-abort"])
def test_the_step_copies_no_state_on_entry(mesh, on_anomaly):
    data, fsdp, tensor = mesh
    overrides = [*SMALL, f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}",
                 f"--config.mesh.tensor={tensor}", f"--config.train.on_anomaly={on_anomaly}"]
    cfg = validate(build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(overrides)[1]), 8)
    runner, _, batch, _, _ = prepared_step(cfg)
    assert _entry_copies_of_arguments(runner.compiled_for(batch).as_text()) == []
