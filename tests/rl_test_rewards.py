"""A reward for the RL learning tests, imported by the training subprocess as `fn:rl_test_rewards:vowel_fraction`
(tests/ on its PYTHONPATH), which also exercises the `fn:<module>:<function>` form."""


def vowel_fraction(prompt: str, response: str) -> float:
    """The share of the response's non-space characters that are vowels: dense, in [0, 1], about 0.35 for a tiny
    base trained on the corpus, and raised by preferring vowel-heavy tokens anywhere in the response."""
    text = "".join(response.split())
    return sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1)
