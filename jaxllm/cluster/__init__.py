"""Cluster operations: launch templates rendered and submitted to SLURM, the queue read back, dependent job chains
and hyperparameter sweeps (scripts/submit.py, scripts/pipeline.py --launcher slurm, scripts/sweep.py). The
scheduler is SLURM's own: nothing here queues or orders jobs itself."""
