"""Re-export of `jaxllm.objectives.losses` (jaxllm/objectives/losses.py), the real home of this module.

`jaxllm.post.losses` stays importable because users' tools import it; new code imports `jaxllm.objectives.losses`.
"""

from jaxllm.objectives.losses import *  # noqa: F401,F403
from jaxllm.objectives.losses import (DPO_LOSS_TYPES, dpo_loss, bradley_terry_loss, gae, whiten, kl_penalty,
                                      ppo_policy_loss, ppo_value_loss, group_advantages, grpo_loss)  # noqa: F401
