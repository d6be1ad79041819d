"""The one path from configuration values to frozen dataclasses, shared by the training config (jaxllm/config/schema.py,
with `--config.a.b=v` overrides from jaxllm/config/cli.py) and the data-preparation config (jaxllm/data/prep_config.py,
with prepare_data.py's `--clean.min_words=20` and `--data_config FILE`):

    set_value(tree, "clean.min_words", "20", PrepConfig)   # an override lands: key checked, typed by the schema
    cfg = build(PrepConfig, tree)                          # dict or ConfigDict -> frozen dataclass, keys checked

`coerce` is the one value coercer: the field's annotation (bool, int, float, str, X | None, tuple[X, ...], dict or
a nested dataclass) decides, and command-line text and config-file or JSON values go through it alike. Every
error is a `ConfigError` whose message starts with the dotted key, so scripts print one line and exit 2.

Why our own parser and not ml_collections.config_flags (checked with ml-collections 1.1.0 and absl-py on
configs/pretrain.py): an unknown key (`--config.optim.lrr=1`) or section (`--config.nonsense.x=1`) ends in an
AttributeError / KeyError traceback with exit code 1; a bad value (`--config.train.steps=abc`) prints two lines
("FATAL Flags parsing error: ... invalid literal for int() with base 10: 'abc'" and "Pass --helpshort ...") with
exit code 1, naming neither what was expected nor accepting `2.0` for an integer; `--config.model.vocab_size=auto`
is rejected; `yes` is not a boolean. DEFINE_config_dataclass fails on PrepConfig itself (TypeError from
issubclass on its `int | None` annotations) before parsing anything, and its overrides would have to be spelt
`--<flag>.clean.min_words`, not `--clean.min_words`; absl flags have no `nargs="+"` for prepare_data's `--input`.
Keeping the scripts' command lines and one-line errors would mean catching absl's exceptions and rewriting their
texts, a second parser in all but name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

NO_AUTO: Mapping[str, Any] = types.MappingProxyType({})
TRUE_TEXT = ("true", "1", "yes", "on")
FALSE_TEXT = ("false", "0", "no", "off")
NONE_TEXT = ("none", "null", "")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message starts with the offending key."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse `value` of config key `key` unless it is one of `allowed`."""
    if value not in allowed:
        raise ConfigError(key, f"{value!r} is not one of {list(allowed)}")


def check_positive(key: str, value: float) -> None:
    """Refuse `value` of config key `key` unless it is above zero."""
    if value <= 0:
        raise ConfigError(key, f"must be positive, got {value}")


def _bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_TEXT + FALSE_TEXT:
        return value.lower() in TRUE_TEXT
    raise ValueError(value)


def _int(value):
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            value = float(value)  # "2.0", "1e3"
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    raise ValueError(value)


def _float(value):
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(value)
    return float(value)


def _str(value):
    if not isinstance(value, str):
        raise ValueError(value)
    return value


SCALARS = {bool: (_bool, "true/false"), int: (_int, "an integer"), float: (_float, "a number"), str: (_str, "a string")}


def coerce(key: str, tp, value, auto: Mapping[str, Any] = NO_AUTO):
    """`value` (command-line text, or a config file's or JSON value) as annotation `tp`; `auto` maps the keys that
    accept "auto" to what it stores. Raises ConfigError naming `key` and what was expected."""
    if isinstance(value, str) and value == "auto" and key in auto:
        return auto[key]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _optional(key, tp, value, auto)
    if origin is tuple:
        return _tuple(key, typing.get_args(tp)[0], value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, f"{key}.", auto)
    if tp is dict:
        if not is_mapping(value):
            raise ConfigError(key, f"expected a section of values, got {value!r}")
        return dict(value.items())
    if tp is Any:
        return value
    if tp not in SCALARS:
        raise ConfigError(key, f"unsupported field type {tp}")
    parse, expected = SCALARS[tp]
    try:
        return parse(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected {expected}, got {value!r}") from None


def _optional(key: str, tp, value, auto):
    """`X | None`: None, or text none/null/empty, is None; anything else is an X."""
    args = typing.get_args(tp)
    inner = [a for a in args if a is not type(None)]
    if len(inner) != 1:
        raise ConfigError(key, f"unsupported field type {tp}")
    if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in NONE_TEXT)):
        return None
    return coerce(key, inner[0], value, auto)


def _tuple(key: str, item_tp, value) -> tuple:
    """`tuple[X, ...]` from a list or a comma-separated text such as "0.3,0.3" or "(0.3, 0.3)"."""
    if isinstance(value, str):
        value = [v for v in value.strip("()[] ").split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(key, f"expected a comma-separated list, got {value!r}")
    return tuple(coerce(key, item_tp, v.strip() if isinstance(v, str) else v) for v in value)


def is_mapping(value) -> bool:
    """True for the section containers: dicts and ConfigDicts (which are not `Mapping`s)."""
    return isinstance(value, (Mapping, ml_collections.ConfigDict))


def build(cls, values, prefix: str = "", auto: Mapping[str, Any] = NO_AUTO):
    """Frozen dataclass `cls` from a mapping (dict or ConfigDict): unknown keys are errors, missing ones keep their
    defaults (a field without a default is a missing section), and every value goes through `coerce`."""
    if not is_mapping(values):
        raise ConfigError(prefix.rstrip(".") or cls.__name__, f"expected a section of values, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values.keys()) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}", f"unknown key; expected one of {sorted(fields)}")
    missing = [name for name, f in fields.items() if name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{prefix}{missing[0]}", "missing section")
    return cls(**{name: coerce(f"{prefix}{name}", hints[name], value, auto) for name, value in values.items()})


def field_type(schema, name: str):
    """The annotation of field `name` of dataclass `schema`; None where the schema does not say (not a dataclass,
    e.g. the free-form `xla_flags` dict, or a key it lacks, which `build` rejects later)."""
    if not dataclasses.is_dataclass(schema):
        return None
    return typing.get_type_hints(schema).get(name)


def set_value(tree, dotted: str, value, schema, auto: Mapping[str, Any] = NO_AUTO) -> None:
    """Set `<dotted>` in `tree` (nested dicts or a ConfigDict) to `value`, command-line text or a Python value,
    coerced to the field's type in dataclass `schema` (in a free-form section: the type of the value it replaces).
    A key or section the tree lacks is an error listing what it has."""
    parts = dotted.split(".")
    node, tp = tree, schema
    for i, part in enumerate(parts[:-1]):
        if part not in node or not is_mapping(node[part]):
            sections = sorted(k for k in node.keys() if is_mapping(node[k]))
            raise ConfigError(".".join(parts[: i + 1]), f"unknown section; expected one of {sections}")
        node, tp = node[part], field_type(tp, part)
    leaf = parts[-1]
    if leaf not in node:
        raise ConfigError(dotted, f"unknown key; expected one of {sorted(node.keys())}")
    tp = field_type(tp, leaf) or (type(node[leaf]) if type(node[leaf]) in SCALARS else Any)
    _assign(node, leaf, coerce(dotted, tp, value, auto))


def _assign(node, leaf: str, value) -> None:
    try:
        node[leaf] = value
    except TypeError:  # a ConfigDict keeps the type its file stored (an int lr); the schema's type wins
        with node.unlocked():
            del node[leaf]
            node[leaf] = value
