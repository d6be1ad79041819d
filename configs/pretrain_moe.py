"""The default pretraining job (configs/pretrain.py: its data, mesh and schedule) on a mixture of experts: a
Mixtral-style model with 8 experts of 384 hidden units, 2 per token, so a token runs as many MLP weights as the
default job's dense 768, out of four times as many in all.

    python scripts/train.py --config configs/pretrain_moe.py

Every field is documented on its dataclass in jaxllm/config/schema.py (model.num_experts, model.moe_*).
"""

from pathlib import Path

from jaxllm.config.cli import load_config_file


def get_config():
    config = load_config_file(str(Path(__file__).with_name("pretrain.py")))
    with config.unlocked():
        config.workdir = "runs/pretrain_moe"
        config.model.update(family="mixtral", mlp_dim=384, num_experts=8, experts_per_token=2, moe_aux_loss_coef=0.01)
    return config
