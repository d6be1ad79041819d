"""Llama 3.2 1B pretraining on one H200 (141 GB), the shape of README's measured step (batch 8 x 2048, bf16).

    python scripts/train.py --config configs/gpu/llama_1b_h200.py --config.data.path=DIR
    python scripts/bench_gpu_flags.py --config configs/gpu/llama_1b_h200.py   # measure each flag (GPU host)

One device: no collectives, so only flags that change single-GPU code generation. None of the flags below is
measured by jaxllm yet; each line says what it is expected to do for this step (a scan over 16 layers of
bf16 projection GEMMs and cuDNN attention, then a 128256-way head). Defaults cited are those of jaxlib 0.10.2
(read from an --xla_dump_to debug_options dump). scripts/bench_gpu_flags.py drops one flag at a time and flips
model.scan_layers; the GPU-tuning issue keeps or removes each flag by its figures.
"""

from jaxllm.config.schema import apply_preset, default_config_dict


def get_config():
    config = default_config_dict()
    apply_preset(config, "llama_1b")
    config.workdir = "runs/llama_1b_h200"
    config.mesh.update(data=1, fsdp=1, tensor=1, stage=1)
    config.precision.update(params="float32", compute="bfloat16", output="float32")
    # auto: cuDNN's packed-document attention on a GPU in bf16. remat none: this step measured 48.9 GB of
    # temporaries on an H200 without recomputation (README), so recomputing would only cost FLOPs; the whole head
    # at once (loss_chunk 0) is how that step was measured. scan_layers: bench_gpu_flags.py times False too.
    config.model.update(attention="auto", remat="none", loss_chunk=0, scan_layers=True)
    config.optim.update(name="adamw", lr=3e-4, schedule="cosine", warmup_steps=1000, weight_decay=0.1)
    config.train.update(steps=20000, batch_size=8, seq_len=2048, eval_every=1000, eval_batches=8)
    config.data.update(path="build/data/pretrain_llama3", num_workers=2)
    config.checkpoint.update(every=1000, keep=3)
    config.xla_flags.update({
        # cuBLAS for every GEMM instead of Triton-emitted fused GEMMs (default on): expected to win on the large plain bf16 projections (D2048 x F8192); unmeasured.
        "xla_gpu_enable_triton_gemm": False,
        # No CUDA-graph command buffers (default: fusions, cuBLAS, cuDNN, custom calls, conditionals): a step of ms-long kernels gains little from fewer launches and saves graph memory; unmeasured.
        "xla_gpu_enable_command_buffer": "",
    })
    config.lock()
    return config
