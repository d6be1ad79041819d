"""Evaluation of a trained model: held-out perplexity, multiple-choice accuracy and the standalone checkpoint
loader (`evaluate`), and task metrics of a generating model (`task_eval`).
"""
