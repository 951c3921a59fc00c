"""absl flags mapped onto the config.

Importing this module defines, on absl's global `FLAGS`:

    --config FILE|PRESET       a YAML config, or a preset: mirrored, multi_worker, ...
    --strategy NAME            strategy
    --precision NAME           precision
    --accumulation_steps N     accumulation_steps
    --zero_stage N             zero_stage
    --checkpoint_dir DIR       checkpoint.dir
    --set KEY=VALUE            any config key, dotted for nested; repeatable

Precedence: the config's defaults, then `--config`, then `--set`, then the named
flags. Values are resolved by the config itself (`tfdist.config`), so flags,
YAML and Python overrides accept the same spellings and give the same errors.

Example (an absl main):

    from absl import app
    import tfdist
    from tfdist import flags as tfdist_flags  # defines the flags

    def main(argv):
        runner = tfdist.Runner.from_flags()
        ...

    if __name__ == "__main__":
        app.run(main)
"""

from __future__ import annotations

from typing import Any

import yaml
from absl import flags

from tfdist import presets
from tfdist.config import Config, field_help, load_config
from tfdist.errors import ConfigError

# Strings, not DEFINE_enum: the config resolves names and aliases in one place.
CONFIG = flags.DEFINE_string("config", None, f"A YAML config file, or a preset's name: "
                             f"{', '.join(presets.names())}.")
STRATEGY = flags.DEFINE_string("strategy", None, field_help("strategy"))
PRECISION = flags.DEFINE_string("precision", None, field_help("precision"))
ACCUMULATION_STEPS = flags.DEFINE_integer("accumulation_steps", None,
                                          field_help("accumulation_steps"))
ZERO_STAGE = flags.DEFINE_integer("zero_stage", None, field_help("zero_stage"))
CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, field_help("checkpoint.dir"))
SET = flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE for any config key, dotted for nested fields "
               "(e.g. --set mirrored.cpu_replicas=2). The value is read as YAML. Repeatable.")

# Named flags and the config keys they set; they win over --set.
_NAMED = {"strategy": "strategy", "precision": "precision",
          "accumulation_steps": "accumulation_steps", "zero_stage": "zero_stage",
          "checkpoint_dir": "checkpoint.dir"}


def config_from_flags(flag_values: flags.FlagValues | None = None) -> Config:
    """Builds the config from parsed flags.

    Args:
        flag_values: Parsed flags holding tfdist's definitions. None: absl's `FLAGS`.

    Raises:
        ConfigError: a malformed `--set`, or anything `load_config` rejects.
    """
    values = flags.FLAGS if flag_values is None else flag_values
    overrides: dict[str, Any] = {}
    for item in values["set"].value:
        key, separator, raw = item.partition("=")
        if not separator or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, such as --set mirrored.cpu_replicas=2. "
                              f"Received: --set {item}")
        overrides[key.strip()] = parse_value(raw, key.strip())
    for flag_name, key in _NAMED.items():
        if values[flag_name].value is not None:
            overrides[key] = values[flag_name].value
    return load_config(values["config"].value, overrides)


def parse_value(raw: str, key: str) -> Any:
    """Reads a command-line value as YAML: `2` is an int, `[a, b]` a list, `x` a string."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}= has a value that is not valid YAML; quote it. "
                          f"Received: {raw!r}") from None
