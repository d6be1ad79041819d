"""Optimisation: the optax chain built from `OptimConfig` (`chain`), Muon on the hidden matrices (`muon`),
PowerSGD gradient compression (`powersgd`) and float16 loss scaling (`loss_scale`).
"""
