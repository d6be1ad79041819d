"""What a running job records about itself, and analyses of its compiled program: metric writers and MFU
(`metrics`, `writers`, `tensorboard`, `wandb_writer`, `progress`, `step_timing`), norms and activation
statistics (`norms`, `activations`, `nonfinite`), profiler traces (`profiler`), the compiled step's memory,
communication and out-of-memory summaries (`memory`, `comms`, `hlo_text`, `replica_groups`, `oom`, `sizes`).
"""
