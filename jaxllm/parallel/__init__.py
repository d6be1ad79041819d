"""Parallelism over the (data, fsdp, expert, tensor, stage) mesh: building the mesh (`mesh`), the logical-axis
rules table that decides every layout (`sharding`), pipeline schedules over the `stage` axis (`pipeline`),
expert parallelism over the `expert` axis (`experts`) and host offload through memory kinds (`offload`).
"""
