"""Llama 3.1 8B pretraining on one node of 8 H100 80 GB: parameters, gradients and AdamW state split 8 ways (fsdp).

    python scripts/train.py --config configs/gpu/llama_8b_h100x8.py --config.data.path=DIR
    python scripts/bench_gpu_flags.py --config configs/gpu/llama_8b_h100x8.py   # measure each flag (GPU host)

Every layer of the scan all-gathers its 218M parameters (0.87 GB in float32) from the 8 devices before use and
reduce-scatters their gradients in the backward scan, so the flags below are about overlapping those collectives
with the layers' matmuls and cuDNN attention. None is measured by jaxllm yet; each line says what it is expected
to do. Defaults cited are those of jaxlib 0.10.2 (read from an --xla_dump_to debug_options dump); left at their
defaults: pipelined reduce-scatter (on) and the highest-priority stream for async collectives (on). With mesh.tensor
> 1 the tensor all-reduces would add --xla_gpu_all_reduce_combine_threshold_bytes to the candidates.
scripts/bench_gpu_flags.py drops one flag at a time and flips model.scan_layers; the GPU-tuning issue keeps or
removes each flag by its figures.
"""

from jaxllm.config.schema import apply_preset, default_config_dict


def get_config():
    config = default_config_dict()
    apply_preset(config, "llama_8b")
    config.workdir = "runs/llama_8b_h100x8"
    config.mesh.update(data=1, fsdp=8, tensor=1, stage=1)
    config.precision.update(params="float32", compute="bfloat16", output="float32")
    # auto: cuDNN attention in bf16. remat minimal_with_context keeps the projections and attention context and
    # recomputes only norms, rotations and the SwiGLU product: --dry_run says 43.5 GiB a device for 2 rows of 4096
    # tokens (remat full: 20.5 GiB, at the cost of recomputing every matmul), within JAX's default 0.75 of 80 GB.
    # The head runs 1024 positions at a time so the [B, T, 128256] float32 logits never exist whole.
    # scan_layers: bench_gpu_flags.py times False too.
    config.model.update(attention="auto", remat="minimal_with_context", loss_chunk=1024, scan_layers=True)
    config.optim.update(name="adamw", lr=3e-4, schedule="cosine", warmup_steps=2000, weight_decay=0.1)
    config.train.update(steps=50000, batch_size=16, seq_len=4096, eval_every=1000, eval_batches=8)
    config.data.update(path="build/data/pretrain_llama3", num_workers=2)
    config.checkpoint.update(every=1000, keep=3)
    config.xla_flags.update({
        # Schedule async collectives to overlap with compute (default off): the per-layer FSDP all-gathers and reduce-scatters are the step's exposed communication; unmeasured.
        "xla_gpu_enable_latency_hiding_scheduler": True,
        # Start layer l+1's parameter all-gather inside iteration l of the layer scan (default off), so it can hide behind layer l's matmuls; unmeasured.
        "xla_gpu_enable_pipelined_all_gather": True,
        # Unroll the layer while loop by two with double-buffered carries (default off), giving the pipelined gathers room to overlap without copies; unmeasured.
        "xla_gpu_enable_while_loop_double_buffering": True,
        # Combine all-gathers up to 1 GiB (one layer's 0.87 GB of float32 parameters) into one NCCL call per layer rather than several small ones; unmeasured.
        "xla_gpu_all_gather_combine_threshold_bytes": 1073741824,
        # The same for the backward scan's gradient reduce-scatters (one layer's gradients, 0.87 GB); unmeasured.
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 1073741824,
        # cuBLAS for every GEMM instead of Triton-emitted fused GEMMs (default on): expected to win on the large plain bf16 projections (D4096 x F14336); unmeasured.
        "xla_gpu_enable_triton_gemm": False,
        # No CUDA-graph command buffers (default: fusions, cuBLAS, cuDNN, custom calls, conditionals): ms-long kernels gain little from fewer launches, and graphs hold memory; unmeasured.
        "xla_gpu_enable_command_buffer": "",
    })
    config.lock()
    return config
