"""Llama 3.2 1B pretraining on one H200 (141 GB), bf16 compute: the best setting of the measured grid.

    python scripts/train.py --config configs/gpu/llama_1b_h200.py --config.data.path=DIR
    python scripts/bench_grid.py --config configs/gpu/llama_1b_h200.py --grid configs/gpu/llama_1b_h200_grid.json \
        --out DIR   # the grid on a GPU host (see docs/benchmarks.md, "Dense grid on one H200")

Measured on one H200 (2026-12-04, jax 0.11.2): batch 16 x 2048 with the layer loop unrolled, chunked
cross-entropy and XLA's default flags ran at 64,961 tokens/s, 54.0% MFU, against 45,624 tokens/s (37.9%) for the
previous preset (batch 8, scanned layers, whole head, cuBLAS-only GEMMs and no command buffers).
"""

from jaxllm.config.schema import apply_preset, default_config_dict


def get_config():
    config = default_config_dict()
    apply_preset(config, "llama_1b")
    config.workdir = "runs/llama_1b_h200"
    config.mesh.update(data=1, fsdp=1, tensor=1, stage=1)
    config.precision.update(params="float32", compute="bfloat16", output="float32")
    # auto: cuDNN's packed-document attention on a GPU in bf16. remat none: 76.7 GB of temporaries at batch 16.
    # scan_layers False: the scanned loop spent 7-19% of the step copying layer slices (profile in
    # docs/benchmarks.md); unrolled it ran 1.15-1.25x faster. loss_chunk 1024: the head's logits a chunk at a time,
    # which is what lets batch 16 fit (the whole head at batch 16 asked for 122 GiB).
    config.model.update(attention="auto", remat="none", loss_chunk=1024, scan_layers=False)
    config.optim.update(name="adamw", lr=3e-4, schedule="cosine", warmup_steps=1000, weight_decay=0.1)
    config.train.update(steps=20000, batch_size=16, seq_len=2048, eval_every=1000, eval_batches=8)
    config.data.update(path="build/data/pretrain_llama3", num_workers=2)
    config.checkpoint.update(every=1000, keep=3)
    # No XLA flags: the two this preset held (xla_gpu_enable_triton_gemm=false, xla_gpu_enable_command_buffer='')
    # measured 1.2-1.3x slower together than XLA's defaults (docs/benchmarks.md); XLA's Triton GEMM fusions
    # take 15% of the best step.
    config.lock()
    return config
