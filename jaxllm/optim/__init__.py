"""Optimisation: the optax chain built from `OptimConfig` (`chain`), PowerSGD gradient compression
(`powersgd`) and float16 loss scaling (`loss_scale`).
"""
