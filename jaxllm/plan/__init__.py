"""Planning a run before it runs: parameter and per-device byte counts for any mesh (`footprint`), the
activation memory of the train step by formula (`activation_memory`), and `auto` choices of gradient
accumulation and remat from ahead-of-time compiles (`auto_fit`).
"""
