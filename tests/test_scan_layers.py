"""model.scan_layers=False: the stacked layers in an unrolled loop give the scan's loss and gradients (with remat,
LoRA dropout keys, on a sharded mesh and inside pipeline stages), and the compiled step has no layer while loop."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from compile_flags import PRODUCTION_COMPILE
from jaxllm.config.schema import LoRAConfig, MeshConfig, ModelConfig, PipelineConfig, PrecisionConfig
from jaxllm.data.synthetic import synthetic_batch
from jaxllm.parallel.mesh import make_mesh
from jaxllm.parallel.sharding import sharding_tree
from jaxllm.parallel.host_rows import to_global
from jaxllm.model.head import next_token_loss
from jaxllm.model.build import build_model
from jaxllm.train.step import batch_sharding

MODEL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    remat="full")
F32 = PrecisionConfig(params="float32", compute="float32", output="float32")
LORA = LoRAConfig(rank=4, dropout=0.1, targets="q_proj,v_proj,down_proj")
B, T = 8, 16


def _float_while_loops(hlo: str) -> int:
    """While loops of compiled HLO whose carry holds floating-point arrays: the layer scans (and the pipeline's
    loop). The CPU backend also lowers threefry random bits to while loops, but those carry only integers."""
    return sum(bool(re.search(r"\b(f32|bf16)\[", line.split(" while(")[0]))
               for line in hlo.splitlines() if " while(" in line)


def _compiled_loss_and_grads(cfg: ModelConfig, mesh, pipeline: PipelineConfig, lora: LoRAConfig | None):
    """(loss, gradients, number of float while loops in the compiled HLO) of the LM loss (with `lora`: adapters
    whose dropout draws from per-layer keys)."""
    model = build_model(cfg, F32, jax.random.key(0), pipeline, lora=lora)
    graphdef, params = nnx.split(model)
    params = jax.device_put(params, sharding_tree(params, mesh))
    batch = to_global(synthetic_batch(0, B, T, cfg.vocab_size), batch_sharding(mesh), B)

    def loss(p, b):
        loss_sum, count, _ = next_token_loss(nnx.merge(graphdef, p), b, jax.random.key(1))
        return loss_sum / count

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile(PRODUCTION_COMPILE)  # users' loops
    value, grads = compiled(params, batch)
    return value, grads, _float_while_loops(compiled.as_text())


# The pipeline case is kept lean (no adapters, stage only): its compile dominates this file's time.
@pytest.mark.parametrize("mesh_shape, num_layers, microbatches, lora",
                         [((2, 2, 2, 1), 2, 1, LORA), ((1, 1, 1, 2), 4, 2, None)],
                         ids=["data-fsdp-tensor-lora", "pipeline-2-stages"])
def test_unrolled_layers_equal_the_scan(mesh_shape, num_layers, microbatches, lora):
    config = MeshConfig(*mesh_shape)
    mesh = make_mesh(config, jax.devices()[:config.num_devices])
    cfg = dataclasses.replace(MODEL, num_layers=num_layers)
    pipeline = PipelineConfig(microbatches=microbatches)
    with jax.set_mesh(mesh):
        scan_loss, scan_grads, scan_whiles = _compiled_loss_and_grads(cfg, mesh, pipeline, lora)
        loop_loss, loop_grads, loop_whiles = _compiled_loss_and_grads(
            dataclasses.replace(cfg, scan_layers=False), mesh, pipeline, lora)
    np.testing.assert_allclose(float(loop_loss), float(scan_loss), rtol=1e-6, atol=1e-6)
    assert jax.tree.structure(loop_grads) == jax.tree.structure(scan_grads)
    for got, want in zip(jax.tree.leaves(jax.device_get(loop_grads)), jax.tree.leaves(jax.device_get(scan_grads))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if config.stage == 1:  # forward and backward layer scans gone; nothing else loops
        assert scan_whiles >= 2 and loop_whiles == 0, (scan_whiles, loop_whiles)
    else:  # the pipeline's own iteration loops stay; the layer scans nested in them go
        assert loop_whiles < scan_whiles, (scan_whiles, loop_whiles)


def _decode_program(cfg: ModelConfig, prompts):
    """(new tokens, their log-probabilities, the compiled decode program's text) of greedy KV-cache decoding."""
    from jaxllm.model import sample

    graphdef, params = nnx.split(build_model(cfg, F32, jax.random.key(0)))
    tokens, start = sample.left_pad(prompts)
    new, logps = sample.decode(graphdef, params, tokens, start, max_new_tokens=6)
    stops = np.full((sample.STOP_SLOTS,), sample.NO_TOKEN, np.int32)
    compiled = sample._decode.lower(graphdef, params, tokens, start, np.int32(6), stops, np.float32(1e-6),
                                    np.int32(0), np.float32(1.0), np.int32(sample.ALL_IDS), jax.random.key(0),
                                    cache_len=sample.bucket(tokens.shape[1] + 6), sampling=False).compile()
    return np.asarray(new), np.asarray(logps), compiled.as_text()


def test_unrolled_decode_equals_the_scan_and_slices_no_weight_per_token():
    """Decoding with the layers unrolled gives the scanned decode's tokens and log-probabilities, and its token
    loop carries per-layer weights sliced once before it: no stacked [L, ...] array enters the while loop (a
    slice inside it is a copy of every weight at every token)."""
    cfg = dataclasses.replace(MODEL, num_layers=3, remat="none")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    scan_new, scan_logps, scan_text = _decode_program(cfg, prompts)
    loop_new, loop_logps, loop_text = _decode_program(dataclasses.replace(cfg, scan_layers=False), prompts)
    np.testing.assert_array_equal(loop_new, scan_new)
    np.testing.assert_allclose(loop_logps, scan_logps, rtol=1e-5, atol=1e-6)

    def stacked_in_token_loop(text):
        loop = next(line for line in text.splitlines() if " while(" in line and "s32[2,16]" in line)
        return re.findall(r"f32\[3,\d+[,\d]*\]", loop.split(" while(")[0])

    assert stacked_in_token_loop(scan_text), "the scanned decode should carry the stacked weights"
    assert not stacked_in_token_loop(loop_text), stacked_in_token_loop(loop_text)
