"""Re-export of `jaxllm.interop.hf` (jaxllm/interop/hf.py), the real home of this module.

`jaxllm.hf` stays importable because users' tools import it; new code imports `jaxllm.interop.hf`.
"""

from jaxllm.interop.hf import *  # noqa: F401,F403  (every public name)
