"""Training diagnostics: statistics that cost the production step nothing, and what they say about a run
(DESIGN.md section 10).

- `norms`: global norms the production step reports every step (gradient norm after clipping, parameter and
  update norms, their ratio), and the per-layer / per-group norms of gradients, parameters and updates and the
  optimizer's second-moment statistics that only the diagnostic variant computes.
- `activations`: per-layer statistics of the residual stream, the SwiGLU gate and the attention logits, and of
  the output logits, from one probed forward pass.
- `variant`: the diagnostic variant of the train step, run every `diagnostics.every` steps beside the
  production step (the same update, with more outputs), and the analysis of a non-finite step.
- `nonfinite`: naming the first layer whose parameters, activations or gradients went non-finite.
- `writers` (`tensorboard`, `wandb_writer`): every metrics record to metrics.jsonl, TensorBoard and wandb.
- `profiler`, `memory`, `step_timing`: jax.profiler traces of chosen steps, the compiled step's memory, and
  the host's share of each step (data wait, checkpoint blocking, evaluation).
- `comms` (`hlo_text`, `replica_groups`): the bytes the compiled step's collectives move, by kind and mesh axes.
- `oom`: a readable summary of an out-of-memory error.
- `run_data`, `signals`, `findings`, `layer_rules`, `system_rules`, `diagnosis`, `plots`, `report`: the
  diagnosis of a finished run (scripts/diagnose.py): its records turned into findings, plots and a report.

Every statistic reaches metrics.jsonl under a `diag/` prefix (jaxllm/train/metrics_log.py).
"""
