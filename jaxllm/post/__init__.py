"""Kept only so that `jaxllm.post.losses` keeps importing: the post-training modules live in
`jaxllm.objectives` (the losses in `jaxllm.objectives.losses`).
"""
