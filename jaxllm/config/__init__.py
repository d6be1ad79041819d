"""Configuration: the typed schema the ConfigDict of `configs/*.py` is validated into (`schema`, and the sections
of the fine-tuning objectives in `fine_tuning`), the one path from values to frozen dataclasses shared with the
data-preparation config (`typed_config`), the scripts' command-line plumbing (`cli`: `--config FILE`,
`--config.a.b=value`, one-line errors) and the resolution of `precision.compute=auto` (`auto_precision`).
"""
