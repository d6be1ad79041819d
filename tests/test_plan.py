"""The memory planner: temporaries by formula against an ahead-of-time compile, and the fits verdict."""

import pytest

from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import validate
from jaxllm.plan.footprint import GPUS, fit_verdict, format_plan, memory_plan

from train_runs import ROOT


def _cfg(*overrides):
    cd = build_config(str(ROOT / "configs" / "pretrain.py"), split_overrides(list(overrides))[1])
    return validate(cd, cd.mesh.data * cd.mesh.fsdp * cd.mesh.tensor * cd.mesh.stage * cd.mesh.context)


CONTEXT = ("--config.mesh.data=1", "--config.mesh.context=2", "--config.train.seq_len=512")


@pytest.mark.parametrize("overrides", [(), ("--config.model.remat=full",), ("--config.model.loss_chunk=32",),
                                       CONTEXT, CONTEXT + ("--config.model.context_attention=ring",)],
                         ids=["remat-none", "remat-full", "loss-chunk", "context-all-gather", "context-ring"])
def test_formula_is_within_a_quarter_of_the_compiled_temporaries(overrides):
    cfg = _cfg("--config.model.vocab_size=4096", *overrides)
    compiled = memory_plan(cfg, compiled=True)
    formula = memory_plan(cfg, compiled=False)
    assert compiled["temp_source"] == "compiled on cpu"
    attention = "ring" if "--config.model.context_attention=ring" in overrides else "xla"  # float32: no cuDNN
    assert formula["temp_source"] == f"formula, attention {attention} as on a GPU"
    ratio = formula["temp_bytes_per_device"] / compiled["temp_bytes_per_device"]
    assert 0.75 < ratio < 1.25, (ratio, formula["temp_parts"], compiled["temp_bytes_per_device"])
    assert formula["total_bytes_per_device"] == sum(formula[k] for k in (
        "frozen_bytes_per_device", "param_bytes_per_device", "opt_bytes_per_device", "temp_bytes_per_device"))


def test_the_verdict_names_each_gpu_and_the_memory_fraction_it_needs():
    h100 = GPUS["H100 80 GB"]
    assert fit_verdict(int(0.5 * h100), h100) == "fits"
    assert fit_verdict(int(0.861 * h100), h100) == "fits with XLA_PYTHON_CLIENT_MEM_FRACTION >= 0.87"
    assert fit_verdict(h100, h100) == "does not fit"
    plan = memory_plan(_cfg("--config.model.preset=llama_1b", "--config.mesh.data=1", "--config.mesh.fsdp=1",
                            "--config.mesh.tensor=1", "--config.train.batch_size=8", "--config.train.seq_len=2048"),
                       compiled=False)
    text = format_plan(plan)
    assert "attention cudnn as on a GPU" in text  # the preset computes in bfloat16
    assert f"H100 80 GB (79.647 GiB): {plan['fits']['H100 80 GB']}" in text
    assert plan["fits"]["H200 141 GB"] == "fits"
