"""Re-export of `jaxllm.objectives.reward_fns` (jaxllm/objectives/reward_fns.py), the real home of the reward
function registry: configs that name `fn:jaxllm.post.rewards:<function>` keep working."""

from jaxllm.objectives.reward_fns import *  # noqa: F401,F403
