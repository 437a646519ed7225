"""Loading a config: YAML files and `--group.key=value` overrides applied to config.py's dataclasses,
each value checked against its default's type; the error a bad key or value raises (ConfigError).

    cfg = load(config.Config(), ["configs/tiny.yaml", "--grpo.clip_high=0.28"])   # = config.load_config
    text = dump(cfg); cfg = from_dict(config.Config(), yaml.safe_load(text))        # a checkpoint's config.yaml
Generic: it reads the dataclasses it is given (groups of plain fields; a field's metadata "choices"
restricts a str), so config.py holds the hyperparameters and nothing else.
Tests: .venv/bin/pytest tests/test_config.py
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml


class ConfigError(ValueError):
    pass


def _fields(dc) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(dc)}


def all_keys(cfg) -> dict[str, Any]:
    """Flat {"group.key": value} of a config."""
    return {f"{g}.{k}": v for g, grp in to_dict(cfg).items() for k, v in grp.items()}


# old key -> new key: a config written before a rename fails naming the new key
RENAMED = {
    "env.max_rows": "env.max_result_rows",
    "env.actions_max_rows": "env.actions_max_result_rows",
    "sampling.max_rows": "sampling.max_decode_rows",
}


def _unknown(key: str, valid: list[str]) -> ConfigError:
    if key in RENAMED:
        return ConfigError(f"config key '{key}' was renamed {RENAMED[key]}; did you mean {RENAMED[key]}?")
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not close:  # also try the last part alone, e.g. "cliphigh" -> grpo.clip_high
        tail = key.split(".")[-1]
        close = [k for k in valid if difflib.get_close_matches(tail, [k.split(".")[-1]], cutoff=0.6)][:3]
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint} (python config.py lists all keys)")


def _coerce(key: str, value: Any, f: dataclasses.Field, from_string: bool) -> Any:
    """Check `value` against the type of the field's default; strings from the CLI are parsed."""
    default = f.default
    want = type(default)
    if f.metadata.get("auto"):  # an int, or "auto"
        if value == "auto":
            return value
        try:
            parsed = yaml.safe_load(value) if from_string and isinstance(value, str) else value
        except yaml.YAMLError:
            parsed = value
        if isinstance(parsed, bool) or not isinstance(parsed, int):
            raise ConfigError(f"config key '{key}' wants an int or auto, got {value!r}")
        return parsed
    if isinstance(value, str) and want is float:  # YAML 1.1 reads "3e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if from_string and isinstance(value, str) and want is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"config key '{key}': cannot parse {value!r}: {e}") from None
    if want is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' wants a bool (true/false), got {value!r}")
    elif want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and not from_string:
                value = int(value)
            else:
                raise ConfigError(f"config key '{key}' wants an int, got {value!r}")
    elif want is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' wants a float, got {value!r}")
        value = float(value)
    elif want is str:
        if value is None:
            value = ""
        if isinstance(value, bool) and f.metadata.get("choices"):  # YAML `resume: true`
            value = "true" if value else "false"
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' wants a string, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"config key '{key}' must be one of {list(choices)}, got {value!r}")
    return value


def apply(cfg, flat: dict[str, Any], from_string: bool = False):
    """Set dotted keys on cfg in place, type-checked. Returns cfg."""
    valid = list(all_keys(cfg))
    groups = _fields(cfg)
    for key, value in flat.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in groups:
            raise _unknown(key, valid)
        grp = getattr(cfg, parts[0])
        fs = _fields(grp)
        if parts[1] not in fs:
            raise _unknown(key, valid)
        setattr(grp, parts[1], _coerce(key, value, fs[parts[1]], from_string))
    return cfg


def _flatten_yaml(d: Any, path: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of groups, got {type(d).__name__}")
    out = {}
    for g, sub in d.items():
        if isinstance(sub, dict):
            for k, v in sub.items():
                if isinstance(v, dict):
                    raise ConfigError(f"{path}: '{g}.{k}' is nested too deep (groups have plain values)")
                out[f"{g}.{k}"] = v
        else:
            out[str(g)] = sub  # rejected by apply() with a hint
    return out


def yaml_error_text(e: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: 'line L, column C: what' (PyYAML prints it over ~6 lines)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else \
        f"YAML syntax error: {what}"


def load(cfg, argv: list[str]):
    """argv: [config.yaml] [--group.key=value ...] (a YAML path is optional), applied to `cfg` in
    place (config.load_config passes the defaults, or a checkpoint's saved config). Returns cfg."""
    argv = list(argv)
    files = [a for a in argv if not a.startswith("--")]
    overrides = [a for a in argv if a.startswith("--")]
    if len(files) > 1:
        raise ConfigError(f"expected at most one config file, got {files}")
    for path in files:
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        except yaml.YAMLError as e:  # a scanner/parser error: say where, on one line
            raise ConfigError(f"{path}: {yaml_error_text(e)}") from None
        apply(cfg, _flatten_yaml(data, path))
    flat = {}
    for a in overrides:
        if "=" not in a:
            raise ConfigError(f"override '{a}' must look like --group.key=value")
        k, v = a[2:].split("=", 1)
        flat[k] = v
    return apply(cfg, flat, from_string=True)


def to_dict(cfg) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def from_dict(cfg, d: dict):
    """Apply to_dict() output (e.g. a checkpoint's config.yaml) to cfg (the defaults it was written
    over): a key renamed since the checkpoint was written is read under its new name, so older runs
    still resume. Returns cfg."""
    flat = {RENAMED.get(k, k): v for k, v in _flatten_yaml(d, "<dict>").items()}
    return apply(cfg, flat)


def dump(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
