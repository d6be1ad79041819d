"""The import paths users' scripts and tools rely on keep working after the packages moved by concern: each is
the real home or a thin re-export of it (the same objects, not copies)."""

import importlib

import pytest

PUBLIC = [
    ("jaxllm.hf", "jaxllm.interop.hf", ("from_pretrained", "save_pretrained")),
    ("jaxllm.lora", "jaxllm.model.lora", ("merge",)),
    ("jaxllm.post.losses", "jaxllm.objectives.losses",
     ("dpo_loss", "bradley_terry_loss", "gae", "whiten", "kl_penalty", "ppo_policy_loss", "ppo_value_loss",
      "group_advantages", "grpo_loss")),
    ("jaxllm.post.rewards", "jaxllm.objectives.reward_fns", ("register", "resolve", "single_line")),
    ("jaxllm.train.loop", "jaxllm.launch.train", ("train",)),
    ("jaxllm.model.blockwise", "jaxllm.model.blockwise", ("nf4_quantize", "nf4_dequantize")),
]


@pytest.mark.smoke
@pytest.mark.parametrize("public, home, names", PUBLIC, ids=[p for p, _, _ in PUBLIC])
def test_public_import_paths_give_the_real_objects(public, home, names):
    old, new = importlib.import_module(public), importlib.import_module(home)
    for name in names:
        assert getattr(old, name) is getattr(new, name), name


def test_every_public_loss_is_re_exported():
    old, new = importlib.import_module("jaxllm.post.losses"), importlib.import_module("jaxllm.objectives.losses")
    public = {n for n, v in vars(new).items() if callable(v) and not n.startswith("_")
              and getattr(v, "__module__", "") == new.__name__}
    assert public and all(getattr(old, n, None) is getattr(new, n) for n in public), sorted(public)


def test_a_reward_function_named_by_its_old_module_path_resolves():
    from jaxllm.objectives import reward_fns

    assert reward_fns.resolve("fn:jaxllm.post.rewards:single_line") is reward_fns.single_line
