"""Re-export of `jaxllm.interop.hf` (jaxllm/interop/hf.py), the real home of this module.

`jaxllm.hf` stays importable because users' tools import it; new code imports `jaxllm.interop.hf`.
"""

from jaxllm.interop.hf import *  # noqa: F401,F403
from jaxllm.interop.hf import (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, Transform, IDENTITY, TRANSPOSE,
                               SPLIT_OUT_HEADS, SPLIT_IN_HEADS, Row, TABLE, REWARD_TABLE, REWARD_ARCHITECTURE,
                               is_reward_config, config_from_hf, rope_scaling_from_hf, config_to_hf,
                               from_pretrained, save_pretrained)  # noqa: F401
