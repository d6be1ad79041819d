"""Re-export of `jaxllm.model.lora` (jaxllm/model/lora.py), the real home of this module.

`jaxllm.lora` stays importable because users' tools import it; new code imports `jaxllm.model.lora`.
"""

from jaxllm.model.lora import *  # noqa: F401,F403  (every public name)
