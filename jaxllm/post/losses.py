"""Re-export of `jaxllm.objectives.losses` (jaxllm/objectives/losses.py), the real home of this module.

`jaxllm.post.losses` stays importable because users' tools import it; new code imports `jaxllm.objectives.losses`.
"""

from jaxllm.objectives.losses import *  # noqa: F401,F403  (every public name)
