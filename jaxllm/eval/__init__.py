"""Evaluation of a trained model: held-out perplexity, multiple-choice accuracy (`evaluate`), task metrics of a
generating model (`task_eval`), and the `jaxllm` model of EleutherAI's lm-evaluation-harness (`harness`, needing
the eval extra) with its packed log-likelihood scoring (`scoring`).
"""
