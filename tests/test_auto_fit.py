"""`optim.grad_accum=auto` and `model.remat=auto` (jaxllm/plan/auto_fit.py): with a budget between two candidates'
compiled memory the chosen setting fits and the next larger does not, and a run with auto trains exactly as the
same setting chosen by hand. `train.memory_budget_gb` stands in for the device limit the CPU does not report."""

import dataclasses
import io

import pytest

from jaxllm.plan.auto_fit import accum_candidates, choose, step_device_bytes, with_setting
from jaxllm.observe.sizes import GB
from jaxllm.config.cli import build_config, split_overrides
from jaxllm.config.schema import ConfigError, validate
from jaxllm.train.loop import train

from train_runs import ROOT, TINY, losses

CONFIG = str(ROOT / "configs" / "pretrain.py")
FRACTION = 0.5  # train.memory_fraction: the budget is this share of train.memory_budget_gb


def _cfg(*overrides):
    return validate(build_config(CONFIG, split_overrides([*TINY, *overrides])[1]), 8)


def _budget_between(fits: int, too_big: int) -> str:
    """A train.memory_budget_gb whose FRACTION lies halfway between two candidates' bytes."""
    assert fits < too_big
    return f"--config.train.memory_budget_gb={(fits + too_big) / 2 / FRACTION / GB!r}"


RUN = ("--config.train.steps=3", "--config.train.eval_every=1000", "--config.checkpoint.every=1000",
       "--config.train.hang_timeout_s=0")


def _run(store, workdir, *overrides) -> tuple[dict[int, float], str]:
    """(losses by step, log) of 3 steps of the tiny job trained in this process."""
    cfg = _cfg(f"--config.data.path={store}", *RUN, *overrides)
    out = io.StringIO()
    train(dataclasses.replace(cfg, workdir=str(workdir)), stream=out)
    return losses(workdir), out.getvalue()


def test_grad_accum_auto_takes_the_largest_micro_batch_that_fits_and_trains_as_chosen_by_hand(shakespeare_store,
                                                                                               tmp_path):
    base = _cfg(f"--config.data.path={shakespeare_store}", *RUN)  # batch 16 over data 2 x fsdp 2
    assert accum_candidates(base) == [1, 2, 4]
    one, two = (step_device_bytes(with_setting(base, "none", a)) for a in (1, 2))
    budget = _budget_between(two, one)
    auto, log = _run(shakespeare_store, tmp_path / "auto", "--config.optim.grad_accum=auto", budget,
                     f"--config.train.memory_fraction={FRACTION}")
    assert "chose model.remat=none, optim.grad_accum=2 (micro-batch 8 of train.batch_size=16)" in log
    table = log[log.index("optim.grad_accum=auto"):log.index("chose")].splitlines()
    assert [line.split()[-1] for line in table[2:]] == ["no", "yes"]  # 1 micro-batch does not fit, 2 do
    by_hand, _ = _run(shakespeare_store, tmp_path / "hand", "--config.optim.grad_accum=2")
    assert auto == by_hand and len(auto) == 3


def test_remat_auto_takes_the_least_recomputation_that_fits():
    base = _cfg()
    none, save_dots = (step_device_bytes(with_setting(base, r, 1)) for r in ("none", "save_dots"))
    cfg = _cfg("--config.model.remat=auto", _budget_between(save_dots, none),
               f"--config.train.memory_fraction={FRACTION}")
    lines = []
    chosen = choose(cfg, lines.append)
    assert (chosen.model.remat, chosen.optim.grad_accum) == ("save_dots", 1)
    assert "model.remat=auto" in lines[0] and lines[0].rstrip().endswith("yes")
    assert save_dots <= FRACTION * cfg.train.memory_budget_gb * GB < none


def test_auto_needs_a_budget_on_cpu_and_a_candidate_that_fits():
    with pytest.raises(ConfigError, match="train.memory_budget_gb: auto needs a memory limit and the cpu devices "
                                          "report none"):
        choose(_cfg("--config.optim.grad_accum=auto"))
    # batch 4 over data x fsdp = 4 rows: one micro-batch is the only candidate, and 1 kB fits nothing
    with pytest.raises(ConfigError, match=r"optim.grad_accum: no candidate fits 0.000 GB per device .*raise "
                                          "mesh.fsdp"):
        choose(_cfg("--config.optim.grad_accum=auto", "--config.train.batch_size=4",
                    "--config.train.memory_budget_gb=1e-6"), lambda msg: None)
    with pytest.raises(ConfigError, match="model.remat_offload: 'host' offloads what a named model.remat policy"):
        _cfg("--config.model.remat=auto", "--config.model.remat_offload=host")


class _Chosen(Exception):
    """Raised by the stand-in for auto_fit.choose once it has seen the config auto-fit would choose for."""


@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_auto_fit_chooses_for_the_base_s_architecture_and_the_rollout_rows(objective, bases, tmp_path, monkeypatch):
    """train() sizes "auto" settings for the model that will train: a fine-tuning run's base's architecture (tiny
    here, not the config file's), and for RL the rollout rows' length, not train.seq_len."""
    from jaxllm.plan import auto_fit
    from jaxllm.objectives.rl import prompt_bucket

    seen = []

    def stand_in(cfg, log=print):
        seen.append(cfg)
        raise _Chosen

    monkeypatch.setattr(auto_fit, "choose", stand_in)
    overrides = [f"--config.checkpoint.restore_from={bases[0]}", "--config.model.remat=auto",
                 f"--config.workdir={tmp_path / 'run'}", f"--config.{objective}.train_file=unused.jsonl",
                 "--config.train.seq_len=64"]  # not the rollout rows' 128
    cfg = validate(build_config(str(ROOT / "configs" / f"{'sft_lora' if objective == 'sft' else objective}.py"),
                                split_overrides(overrides)[1]), 8)
    assert (cfg.model.dim, cfg.model.num_layers) != (64, 2)  # the config file's own model is not the base's
    with pytest.raises(_Chosen):
        train(cfg, stream=io.StringIO())
    (chosen,) = seen
    assert (chosen.model.dim, chosen.model.num_layers, chosen.model.vocab_size) == (64, 2, 512)  # the tiny base
    if objective == "grpo":
        rows = prompt_bucket(cfg.grpo.max_prompt_tokens, cfg.grpo.max_prompt_tokens) + cfg.grpo.max_new_tokens
        assert chosen.train.seq_len == rows != cfg.train.seq_len


def test_a_fine_tuning_vocabulary_of_auto_is_sized_from_its_tokenizer_before_the_objective_is_built(
        shakespeare_store, tmp_path):
    """SFT without a base: the resolution phase sizes model.vocab_size=auto from sft.tokenizer (the objective is
    then built from the resolved config and changes no setting); plans see the same size."""
    from jaxllm.config.schema import AUTO_VOCAB
    from jaxllm.objectives.registry import resolved_shape

    overrides = ["--config.checkpoint.restore_from=", "--config.model.vocab_size=auto",
                 f"--config.sft.tokenizer={shakespeare_store / 'tokenizer.model'}",
                 "--config.sft.train_file=unused.jsonl", f"--config.workdir={tmp_path / 'run'}"]
    cfg = validate(build_config(str(ROOT / "configs" / "sft_lora.py"), split_overrides(overrides)[1]), 8)
    assert cfg.model.vocab_size == AUTO_VOCAB
    assert resolved_shape(cfg).model.vocab_size == 512  # the store's tokenizer
