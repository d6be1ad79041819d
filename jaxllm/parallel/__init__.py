"""Parallelism over the (data, fsdp, tensor, stage) mesh: building the mesh (`mesh`), the logical-axis rules
table that decides every layout (`sharding`), pipeline schedules over the `stage` axis (`pipeline`) and host
offload through memory kinds (`offload`).
"""
