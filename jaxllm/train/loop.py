"""The public path of `train` (`from jaxllm.train.loop import train`), kept for users' scripts: the entry lives in
jaxllm/launch/train.py (it resolves auto values and builds the objective) and the shared loop in
jaxllm/train/fit.py."""

from jaxllm.launch.train import train  # noqa: F401  (the public name)
