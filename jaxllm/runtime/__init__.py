"""The processes of a job: multi-process start-up and rendezvous (`distributed`), naming a peer that died
(`peer_watch`), clean exits on SIGTERM (`preemption`), the hang watchdog (`watchdog`) and the XLA flags a
config carries (`xla_flags`).
"""
