# `make train`: install, prepare the shipped corpus, train the default model on 8 fake CPU devices.
# `make sft`:   after `make train`, LoRA-fine-tune its model on the shipped SFT task (configs/sft_lora.py).
# `make reward`: after `make train`, train a reward model from its model on the shipped preference pairs.
# `make dpo`:   after `make sft`, DPO on the same pairs with new adapters on the merged SFT model.
# `make grpo`:  after `make sft`, GRPO with new adapters on the merged SFT model, rewarded by fn:ends_sentence.
# `make ppo`:   after `make sft`, PPO (policy and critic adapters on the merged SFT model), same reward; add
#               ARGS="--config.ppo.reward=rm:runs/reward --config.workdir=runs/ppo_rm" (after `make reward`) to be
#               rewarded by the reward model (a workdir of its own: a run resumes only under its reward).
# `make pipeline`: the whole life of a model from nothing: prepare, pretrain, SFT, reward model, PPO (~31 min);
#               ARGS=--launcher=slurm submits the stages as dependent SLURM jobs instead (docs/clusters.md).
# `make eval`:  after `make train`, evaluate its model on the offline lm-evaluation-harness task pack eval_tasks/
#               (held-out perplexity, MC, cloze, the SFT task's generations; eval_tasks/README.md); EVAL_RUN=runs/sft_lora
#               (any run, checkpoint or Hugging Face model directory) evaluates another, ARGS adds lm_eval options.
# `make test`:  install with test extras and run the whole suite (tests/conftest.py forces 8 CPU devices) in
#               TEST_WORKERS pytest-xdist processes (default 2), one test file per worker at a time.
# `make docs`:  install the docs extra and build the documentation site (mkdocs.yml, docs/) strictly into build/site.
# `make docs-check`: run every command block of the docs not marked as skipped (needs a GPU, a cluster or your own
#               files); by hand, not in CI: it trains the shipped jobs on CPU (hours). tests/docs_check.py --list lists them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DATA := build/data/shakespeare
SFT_TASK := build/data/sft_task
PAIRS := build/data/preference
EVAL_RUN ?= runs/pretrain
CPU_DEVICES := XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=180" JAX_PLATFORMS=cpu

.PHONY: install data train sft reward dpo grpo ppo pipeline long-context eval test test-smoke bench bench-peers docs docs-check \
	clean check-sft check-reward check-dpo check-grpo check-ppo check-long-context check-eval

# `make install` installs what training needs (the package and its dependencies); `make test` adds the test extra
# (the reference libraries of the parity tests: torch, transformers, peft, trl; pytest and its plugins) on top.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

data: $(DATA)/manifest.json

$(DATA)/manifest.json: $(VENV)/.installed data/shakespeare.jsonl.gz
	$(BIN)/python scripts/prepare_data.py --input data/shakespeare.jsonl.gz --output $(DATA) --vocab_size 512

train: data
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/pretrain.py $(ARGS)

# A post-training target first checks that the run it starts from exists, before it installs or builds anything
# (make runs a target's prerequisites left to right).
$(addprefix check-,sft reward long-context): check-%:
	@test -d runs/pretrain/checkpoints || { echo "error: make $* starts from the model of make train (runs/pretrain): run make train first" >&2; exit 2; }

$(addprefix check-,dpo grpo ppo): check-%:
	@test -d runs/sft_lora/checkpoints || { echo "error: make $* starts from the model of make sft (runs/sft_lora): run make sft first" >&2; exit 2; }

$(SFT_TASK)/train.jsonl: $(VENV)/.installed data/shakespeare.jsonl.gz scripts/make_sft_task.py
	$(BIN)/python scripts/make_sft_task.py --out $(SFT_TASK)

sft: check-sft $(SFT_TASK)/train.jsonl
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/sft_lora.py --config.checkpoint.restore_from=runs/pretrain $(ARGS)

$(PAIRS)/train.jsonl: $(VENV)/.installed data/shakespeare.jsonl.gz scripts/make_preference_set.py scripts/make_sft_task.py
	$(BIN)/python scripts/make_preference_set.py --out $(PAIRS)

# Context extension of make train's model to 2048 tokens over context=4 (docs/long-context.md)
long-context: check-long-context data
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/long_context.py $(ARGS)

reward: check-reward $(PAIRS)/train.jsonl
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/reward.py --config.checkpoint.restore_from=runs/pretrain $(ARGS)

dpo: check-dpo $(PAIRS)/train.jsonl
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/dpo.py --config.checkpoint.restore_from=runs/sft_lora $(ARGS)

grpo: check-grpo $(SFT_TASK)/train.jsonl
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/grpo.py --config.checkpoint.restore_from=runs/sft_lora $(ARGS)

ppo: check-ppo $(SFT_TASK)/train.jsonl
	$(CPU_DEVICES) $(BIN)/python scripts/train.py --config configs/ppo.py --config.checkpoint.restore_from=runs/sft_lora $(ARGS)

# The evaluation harness (lm-eval, the eval extra) goes into the same venv. make eval checks its model first, as the
# post-training targets do: make train's checkpoints by default, or whatever EVAL_RUN names. The pack's data files are
# committed (scripts/make_eval_tasks.py rebuilds them) and named relative to the repository root, where this runs.
$(VENV)/.installed-eval: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[eval]'
	touch $@

check-eval:
	@test -d $(EVAL_RUN)/checkpoints || { test "$(EVAL_RUN)" != runs/pretrain && test -e "$(EVAL_RUN)"; } || { echo \
	  "error: make eval evaluates EVAL_RUN=$(EVAL_RUN), which is missing (by default the model of make train: run make train first)" >&2; exit 2; }

eval: check-eval $(VENV)/.installed-eval
	$(CPU_DEVICES) HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m jaxllm.eval.harness --model jaxllm \
	  --model_args checkpoint=$(EVAL_RUN) --include_path eval_tasks --tasks jaxllm_pack $(ARGS)

pipeline: install
	$(CPU_DEVICES) $(BIN)/python scripts/pipeline.py $(ARGS)

# Tiny-model tests spend most of their time in XLA's single-threaded compiler, so two workers on two cores take
# about half the wall time of one (measured: 21.6 vs 43.6 min). --dist loadfile keeps a file's module fixtures
# (shared reference runs) in one worker.
TEST_WORKERS ?= 2

test: $(VENV)/.installed-test
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(ARGS)

# The short subset that CI also runs under Python 3.12 with current JAX, to catch API drift early.
test-smoke: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m smoke $(ARGS)

bench: data
	$(CPU_DEVICES) $(BIN)/python scripts/bench_step.py --config configs/pretrain.py $(ARGS)

# `make bench-peers`: jaxllm's step against a bare JAX step and MaxText 0.2.5 on the same Llama, all on jax 0.12 in
# two Python 3.12 environments built here once (~1.5 GB; PYTHON312 names the interpreter), then
# scripts/bench_peers.py (ARGS=--configs small --devices 8 --rounds 1 for a short run; hours for the whole table).
PYTHON312 ?= python3.12
PEERS := build/peers

$(PEERS)/jaxllm/.ready: pyproject.toml
	rm -rf $(PEERS)/jaxllm && $(PYTHON312) -m venv $(PEERS)/jaxllm
	$(PEERS)/jaxllm/bin/python -m pip install -q -e .
	touch $@

$(PEERS)/maxtext/.ready: scripts/peers/maxtext-requirements.txt
	rm -rf $(PEERS)/maxtext && $(PYTHON312) -m venv $(PEERS)/maxtext
	$(PEERS)/maxtext/bin/python -m pip install -q --no-deps maxtext==0.2.5
	$(PEERS)/maxtext/bin/python -m pip install -q -r scripts/peers/maxtext-requirements.txt
	touch $@

bench-peers: data $(PEERS)/jaxllm/.ready $(PEERS)/maxtext/.ready
	$(PYTHON) scripts/bench_peers.py $(ARGS)

# The documentation site. The docs extra goes into the same venv; mkdocstrings reads jaxllm/ statically (griffe).
docs: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# Every command block of the docs pages, in nav order (tests/docs_check.py; ARGS=--list shows them, --page/--from
# pick up after a failure). The token store is prepared first, as the pages assume.
docs-check: data
	$(BIN)/python tests/docs_check.py $(ARGS)

clean:
	rm -rf build runs
