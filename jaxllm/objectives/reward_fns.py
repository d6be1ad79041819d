"""The registry of programmatic rewards for PPO and GRPO (`ppo.reward=fn:<name>`, `grpo.reward=fn:<name>`).

A reward function is `fn(prompt: str, response: str) -> float`: the prompt's text (the last user turn, before
the template) and the decoded response (up to its EOS, which is not part of the text; a response without one is
penalised by the objective's `missing_eos_penalty`, not here). Register one with the decorator, from any module
the run imports:

    from jaxllm.objectives.reward_fns import register

    @register("mentions_rome")
    def mentions_rome(prompt: str, response: str) -> float:
        return float("Rome" in response)

or name a function of an importable module directly: `fn:my_project.rewards:mentions_rome` imports the module
(installed, or on PYTHONPATH) and calls that function.

Built in:
- `ends_sentence`: 1 when the response's last line ends a sentence (".", "!" or "?", before closing quotes).
- `single_line`: 1 when the response is one non-empty line.
"""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: add `fn` to the registry under `name` (a second function with that name is an error)."""
    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS and REWARDS[name] is not fn:
            raise ValueError(f"reward function {name!r} is registered already")
        REWARDS[name] = fn
        return fn
    return add


def resolve(spec: str) -> RewardFn:
    """The function of `fn:<name>` (registered) or `fn:<module>:<function>`; ValueError (one line) otherwise."""
    kind, _, name = spec.partition(":")
    if kind != "fn" or not name:
        raise ValueError(f"expected fn:<name> or fn:<module>:<function>, got {spec!r}")
    if ":" in name:
        return _imported(name)
    if name not in REWARDS:
        raise ValueError(f"no reward function {name!r}; registered: {', '.join(sorted(REWARDS)) or 'none'}")
    return REWARDS[name]


def _imported(name: str) -> RewardFn:
    module_name, _, function = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import reward module {module_name!r}: {exc}") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ValueError(f"module {module_name!r} has no reward function {function!r}")
    return fn


def ends_a_sentence(line: str) -> bool:
    """Whether `line` ends with ".", "!" or "?" (before closing quotes)."""
    return line.rstrip().rstrip("'\"").endswith((".", "!", "?"))


@register("ends_sentence")
def ends_sentence(prompt: str, response: str) -> float:
    lines = response.strip().splitlines()
    return float(bool(lines) and ends_a_sentence(lines[-1]))


@register("single_line")
def single_line(prompt: str, response: str) -> float:
    return float(bool(response.strip()) and "\n" not in response.strip())

