"""A `jaxllm` model for EleutherAI's lm-evaluation-harness (`lm_eval`): any jaxllm checkpoint that is a language
model, evaluated on its own mesh.

Importing this module registers the model `jaxllm` with lm_eval's registry (lm_eval 0.4 finds models only in its
own list or through `register_model`). Then

    lm_eval.simple_evaluate(model="jaxllm", model_args="checkpoint=runs/pretrain,batch_size=16", tasks=[...])

works, and `python -m jaxllm.eval.harness --model jaxllm --model_args checkpoint=... --tasks ...` runs lm_eval's
command line with the model registered (bad model_args or an unreadable checkpoint: one line, exit 2).

model_args (comma-separated key=value):
    checkpoint      a run's workdir, its checkpoints directory or one step directory (pretraining, SFT (LoRA
                    adapters on their recorded base), DPO, PPO and GRPO policies, `scripts/convert_hf.py import`
                    output), or a Hugging Face model directory (config.json + safetensors)
    step            the checkpoint step (default: the latest)
    batch_size      rows per forward pass of the scoring requests (packed, see jaxllm/eval/scoring.py), and
                    prompts per generation batch (default 16)
    max_length      the longest context in tokens (default: the run's train.seq_len, else 2048): longer inputs
                    are cut from the left, rolling log-likelihoods use windows of it, as the harness does
    add_bos_token   prepend BOS to every encoded string (default true: every jaxllm document starts with BOS;
                    the BOS of a tokenizer.json without one is its EOS)
    tokenizer       a tokenizer.model / tokenizer.json (default: the one the checkpoint records)
    template        the chat template of --apply_chat_template: alpaca, chatml or model (default: the run's
                    sft.template, else model for a tokenizer.json with a chat template, else alpaca)
    dtype           computation dtype (default: the parameters')
    data, fsdp, tensor  mesh axes (default: every device on data)
    seed            seed of sampled generations (default 1234)

Requests. `loglikelihood` requests are encoded as the harness's own `hf` backend encodes them (context and
continuation split on the whole string's tokens, trailing spaces moved to the continuation), truncated from the
left to max_length + 1 tokens, and scored in packed rows (jaxllm/eval/scoring.py). `loglikelihood_rolling` uses
the harness's disjoint windows of max_length. `generate_until` decodes with the KV-cache sampler
(jaxllm.model.sample): greedy unless the task samples; a row stops at EOS or at a token whose text holds one of
the task's stop strings (so no row runs to max_gen_toks past its answer), and its text is cut at the first stop
string, so the result is what generating to the end and cutting would give.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
from flax import nnx
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from jaxllm.config.schema import MeshConfig
from jaxllm.data.sft_template import conversation_text
from jaxllm.data.tokenizer import AnyTokenizer, load_tokenizer
from jaxllm.eval.scoring import Scored, batch_multiple, score
from jaxllm.model.sample import generate

MODEL_NAME = "jaxllm"
DEFAULT_ROWS = 16
DEFAULT_MAX_LENGTH = 2048  # lm_eval's own default for a model that does not say
MAX_GEN_TOKS = 256  # the harness's default for a task that does not say
DTYPES = ("float32", "bfloat16", "float16")
ARGS = ("checkpoint", "step", "batch_size", "max_length", "add_bos_token", "tokenizer", "template", "dtype",
        "data", "fsdp", "tensor", "seed")


class HarnessArgumentError(ValueError):
    """A model_args value or a checkpoint the backend cannot use (one line)."""


@dataclasses.dataclass
class LoadedModel:
    """What the backend evaluates: a language model's graphdef and parameters on a mesh, and its tokenizer."""

    graphdef: object
    params: object
    mesh: jax.sharding.Mesh
    tokenizer: AnyTokenizer
    tokenizer_file: Path | None
    max_length: int
    template: str


class JaxLLM(TemplateLM):
    """lm_eval's `jaxllm` model (see the module docstring for its model_args)."""

    def __init__(self, checkpoint: str | None = None, step=None, batch_size=DEFAULT_ROWS, max_length=None,
                 add_bos_token=True, tokenizer=None, template=None, dtype=None, data=None, fsdp=1, tensor=1,
                 seed=1234, max_batch_size=None, device=None, *, loaded: LoadedModel | None = None, **unknown):
        super().__init__()
        check_keys(unknown)
        if loaded is None:
            if not checkpoint:
                raise HarnessArgumentError("model_args: checkpoint=<run, checkpoint or Hugging Face directory> "
                                           "is required")
            loaded = load(str(checkpoint), _int_arg("step", step, None), mesh_arg(data, fsdp, tensor),
                          max_length=_int_arg("max_length", max_length, None), tokenizer=tokenizer,
                          template=template, dtype=dtype)
        self.model = loaded
        self.tokenizer = loaded.tokenizer
        # Fewer rows than the mesh splits a batch into would only be filled up with filler rows.
        multiple = batch_multiple(loaded.mesh)
        self.rows = -(-_batch_size(batch_size) // multiple) * multiple
        self.add_bos_token = _bool_arg("add_bos_token", add_bos_token)
        self.seed = _int_arg("seed", seed, 1234)
        self._texts: list[str] | None = None  # each id's text, for stop strings

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """As lm_eval's, but model_args win over the harness's own batch_size (the CLI always passes one)."""
        args = lm_utils.simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
        return cls(**args, **extra)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    # ------------------------------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self.model.max_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.tokenizer_file or "jaxllm")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None,
                   **kwargs) -> list[int]:
        """The string's ids, after BOS when `add_special_tokens` (None: add_bos_token) says so and the string's
        own encoding does not already start with it (a chat template's text that spells it out)."""
        ids = self.tokenizer.encode(string)
        add = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add and ids[:1] != [self.tokenizer.bos_id]:
            ids = [self.tokenizer.bos_id] + ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------------------------ log-likelihood

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """(summed log-likelihood, is greedy) of each (key, context ids, continuation ids), inputs truncated
        from the left to max_length as the `hf` backend does."""
        scored = []
        for _, context, continuation in requests:
            if not context or not continuation:
                raise ValueError("a loglikelihood request needs context and continuation tokens")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            scored.append(Scored(whole[:-1], whole[1:], len(continuation)))
        results = score(self.model.graphdef, self.model.params, self.model.mesh, scored,
                        max_length=self.max_length, rows_per_call=self.rows)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over the harness's disjoint windows of max_length tokens (the first
        one conditioned on the prefix token), all windows of all documents scored together."""
        windows, owners = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + window)
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generations for (context, gen_kwargs) requests, batched by equal gen_kwargs, longest first."""
        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        out: list[str | None] = [None] * len(requests)
        for members in groups.values():
            contexts = [requests[n].args[0] for n in members]
            for n, text in zip(members, self._generate(contexts, requests[members[0]].args[1])):
                out[n] = text
                self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=None)
        max_new = kwargs.pop("max_gen_toks")
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks {max_new} must be below the model's max_length {self.max_length}")
        sampling = _sampling(kwargs)
        prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) for c in contexts]
        stops = self._stop_ids(until)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts: list[str] = [""] * len(prompts)
        with jax.set_mesh(self.model.mesh):
            for first in range(0, len(order), self.rows):
                chosen = order[first:first + self.rows]
                # Each row's tokens up to and including the one it stopped at (a stop string may end inside it).
                tokens = generate((self.model.graphdef, self.model.params), [prompts[i] for i in chosen],
                                  max_new_tokens=max_new, stop_ids=stops, seed=self.seed + first,
                                  vocab_limit=self.tokenizer.vocab_size, keep_stop=True, **sampling)
                for i, row in zip(chosen, tokens):
                    texts[i] = postprocess_generated_text(self.tok_decode(row), until, None)
        return texts

    def _stop_ids(self, until: list[str]) -> tuple[int, ...]:
        """EOS, and every id whose own text holds a stop string: a sequence's text holds each of its tokens'
        texts, so the stop string is there once such a token is (ids decoding to an incomplete character, part
        of a byte sequence, are left out: their text is not theirs alone)."""
        if self._texts is None:
            self._texts = [self.tokenizer.decode([i]) for i in range(self.tokenizer.vocab_size)]
        found = [i for i, text in enumerate(self._texts)
                 if "\ufffd" not in text and any(s and s in text for s in until)]
        return tuple(dict.fromkeys([self.tokenizer.eos_id, *found]))

    # ----------------------------------------------------------------------------------------- chat

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template --apply_chat_template renders with (its name, or the tokenizer's Jinja for `model`)."""
        if chat_template is False or chat_template is None:
            return None
        if self.model.template == "model":
            return self.tokenizer.chat_template
        return self.model.template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return conversation_text(self.model.template, chat_history, self.tokenizer, add_generation_prompt)


def check_keys(keys) -> None:
    """HarnessArgumentError for the first model_args key the model does not take."""
    unknown = sorted(set(keys) - set(ARGS) - {"max_batch_size", "device"})
    if unknown:
        raise HarnessArgumentError(f"model_args: unknown key {unknown[0]!r} (expected one of {', '.join(ARGS)})")


def _sampling(kwargs: dict) -> dict:
    """The sampler's settings from the harness's generation kwargs (greedy unless do_sample); others are
    refused."""
    do_sample = bool(kwargs.pop("do_sample", False))
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    settings = {"temperature": (temperature or 1.0) if do_sample else 0.0,
                "top_k": int(kwargs.pop("top_k", 0) or 0), "top_p": float(kwargs.pop("top_p", 1.0) or 1.0)}
    if kwargs:
        raise ValueError(f"generation kwargs {sorted(kwargs)} are not supported by the jaxllm model (it takes "
                         "until, max_gen_toks, do_sample, temperature, top_k, top_p)")
    return settings


# ------------------------------------------------------------------------------------------- in training


@functools.lru_cache(maxsize=4)
def _task_manager(include_path: str | None, tasks: tuple[str, ...]):
    """lm_eval's task index: of `include_path` alone when it has every task asked for (indexing lm_eval's own
    thousands of tasks takes seconds, each time), else with lm_eval's own."""
    from lm_eval.tasks import TaskManager

    if include_path:
        own = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in own.all_tasks for t in tasks):
            return own
    return TaskManager(include_path=include_path)


def evaluate_tasks(loaded: LoadedModel, tasks: list[str], *, include_path: str | None = None, limit: int = 0,
                   batch_size: int = DEFAULT_ROWS) -> dict[str, float]:
    """lm_eval's metrics of `tasks` (task or group names) on a model already in memory (the training loop's
    `eval.harness_every`), flat as {"harness/<task>/<metric>": value}: no standard errors (no bootstrap), a
    filter other than "none" kept in the name (`exact_match_strict-match`)."""
    import lm_eval

    model = JaxLLM(loaded=loaded, batch_size=batch_size)
    out = lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=checked_tasks(tasks, include_path),
                                  limit=limit or None, bootstrap_iters=0, log_samples=False, verbosity="WARNING")
    return flat_metrics(out["results"])


def checked_tasks(tasks: list[str], include_path: str | None):
    """lm_eval's task index holding every one of `tasks`; ValueError naming what is missing."""
    if include_path and not Path(include_path).is_dir():
        raise ValueError(f"no such directory {include_path}")
    index = _task_manager(include_path or None, tuple(tasks))
    missing = [t for t in tasks if t not in index.all_tasks]
    if missing:
        raise ValueError(f"no task or group {', '.join(missing)} in {include_path or 'lm_eval'}"
                         f"{' or lm_eval' if include_path else ''}")
    return index


def flat_metrics(results: dict) -> dict[str, float]:
    """lm_eval's {task: {"metric,filter": value}} as {"harness/<task>/<metric>": value} (numbers only; standard
    errors left out)."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if "_stderr" in metric or not filter_name or isinstance(value, bool) or \
                    not isinstance(value, (int, float)):
                continue
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            flat[f"harness/{task}/{name}"] = float(value)
    return flat


# ------------------------------------------------------------------------------------------------ loading


def mesh_arg(data, fsdp, tensor) -> jax.sharding.Mesh:
    """The mesh the backend evaluates on: `fsdp` x `tensor` as given, `data` the rest of the devices (or as
    given: then the mesh takes the first data x fsdp x tensor devices)."""
    from jaxllm.parallel.mesh import make_mesh

    fsdp, tensor = _int_arg("fsdp", fsdp, 1), _int_arg("tensor", tensor, 1)
    count = jax.device_count()
    data = _int_arg("data", data, count // max(fsdp * tensor, 1))
    if data * fsdp * tensor > count or min(data, fsdp, tensor) < 1:
        raise HarnessArgumentError(f"model_args: data={data} x fsdp={fsdp} x tensor={tensor} needs at least one "
                                   f"device each, and at most the {count} there are")
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:data * fsdp * tensor])


def load(checkpoint: str, step: int | None, mesh, *, max_length: int | None = None, tokenizer: str | None = None,
         template: str | None = None, dtype: str | None = None) -> LoadedModel:
    """A checkpoint (or Hugging Face directory) as the backend's model; HarnessArgumentError when it is not a
    readable language model."""
    from jaxllm.model.reward import RewardModel

    if dtype not in (None, *DTYPES):
        raise HarnessArgumentError(f"model_args: dtype={dtype!r} (expected one of {', '.join(DTYPES)})")
    graphdef, params, tokenizer_file, recorded = _read(checkpoint, step, mesh, dtype)
    if isinstance(nnx.merge(graphdef, params), RewardModel):
        raise HarnessArgumentError(f"checkpoint={checkpoint} is a reward model, not a language model")
    tokenizer_file = Path(tokenizer) if tokenizer else tokenizer_file
    if tokenizer_file is None:
        raise HarnessArgumentError(f"checkpoint={checkpoint} records no tokenizer: pass tokenizer=<file>")
    try:
        tok = load_tokenizer(tokenizer_file)
    except (FileNotFoundError, ValueError) as exc:
        raise HarnessArgumentError(f"tokenizer: {exc}") from None
    length = max_length or (recorded.get("train") or {}).get("seq_len") or DEFAULT_MAX_LENGTH
    template = template or (recorded.get("sft") or {}).get("template") or (
        "model" if getattr(tok, "chat_template", None) else "alpaca")
    if template not in ("alpaca", "chatml", "model"):
        raise HarnessArgumentError(f"model_args: template={template!r} (expected alpaca, chatml or model)")
    return LoadedModel(graphdef, params, mesh, tok, tokenizer_file, int(length), template)


def _read(checkpoint: str, step: int | None, mesh, dtype: str | None):
    """(graphdef, params, tokenizer file, recorded run config) of a jaxllm checkpoint or a Hugging Face
    directory."""
    from jaxllm.data.tokenizer import find_tokenizer_file
    from jaxllm.interop import hf
    from jaxllm.runs import base_model
    from jaxllm.runs.checkpoint import CheckpointError
    from jaxllm.runs.loader import load_checkpoint

    path = Path(checkpoint)
    try:
        if base_model.is_hf_directory(path):
            graphdef, params = nnx.split(hf.from_pretrained(path, mesh=mesh, dtype=dtype or "float32"))
            return graphdef, params, find_tokenizer_file(path), {}
        loaded = load_checkpoint(checkpoint, step, mesh, compute=dtype)
    except (FileNotFoundError, ValueError, KeyError, CheckpointError, NotImplementedError) as exc:
        raise HarnessArgumentError(f"checkpoint={checkpoint}: {str(exc).splitlines()[0]}") from None
    return loaded.graphdef, loaded.params, loaded.tokenizer_path(), loaded.config


def _int_arg(key: str, value, default):
    if value is None or value == "":
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise HarnessArgumentError(f"model_args: {key}={value!r} is not an integer") from None


def _bool_arg(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise HarnessArgumentError(f"model_args: {key}={value!r} is not true or false")


def _batch_size(value) -> int:
    """Rows per call: an integer; the harness's "auto" takes the default."""
    if isinstance(value, str) and value.startswith("auto"):
        return DEFAULT_ROWS
    rows = _int_arg("batch_size", value, DEFAULT_ROWS)
    if rows < 1:
        raise HarnessArgumentError(f"model_args: batch_size={value} must be at least 1")
    return rows


def main(argv: list[str]) -> int:
    """lm_eval's command line with the `jaxllm` model registered; its usage errors stay lm_eval's. The jaxllm
    model's keys are checked first, before lm_eval indexes its tasks (seconds)."""
    from lm_eval.__main__ import cli_evaluate
    from lm_eval._cli import HarnessCLI

    from jaxllm.config.cli import fail

    # Parsed by lm_eval's own parser (a private attribute of its CLI: lm-eval is pinned to 0.4.13 in the extras),
    # with "run" put first as its CLI does when no subcommand is named.
    command = argv if argv[:1] in (["run"], ["ls"], ["validate"]) or len(argv) < 2 else ["run", *argv]
    try:
        if command[:1] == ["run"]:
            parsed = HarnessCLI()._parser.parse_args(command)
            if parsed.model == MODEL_NAME:
                check_keys(parsed.model_args or {})
        sys.argv = ["lm-eval", *argv]
        cli_evaluate()
    except HarnessArgumentError as exc:
        fail(str(exc))
    return 0


if __name__ == "__main__":  # run as a script: the registered model is the importable module's, not this copy's
    from jaxllm.eval.harness import main as registered_main

    sys.exit(registered_main(sys.argv[1:]))
else:
    register_model(MODEL_NAME)(JaxLLM)
