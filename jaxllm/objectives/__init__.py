"""Training objectives on top of the objective-agnostic core of `jaxllm.train`: pretraining, fine-tuning
and SFT, the reward model, DPO (with its precomputed reference), and RL (PPO, GRPO), together with the
post-training pieces they share: losses, per-sequence values of preference rows, pair accuracy, the registry
of programmatic rewards (`reward_fns`) and rollouts.
"""
