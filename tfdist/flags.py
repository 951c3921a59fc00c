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

The import must come before absl parses the command line (`app.run`), at the top of the
script: a flag absl does not know when it parses is a "Flags parsing error".

Example (an absl main):

    import tfdist
    from tfdist import flags as tfdist_flags  # defines the flags

    def main(argv):
        runner = tfdist.Runner.from_flags()
        ...

    if __name__ == "__main__":
        tfdist_flags.run(main)   # absl's app.run; tfdist's errors as one line, exit 2
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Sequence

import yaml
from absl import app, flags

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


def run(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> None:
    """`absl.app.run(main)`, with bad input as one line and exit status 2.

    A `tfdist.ConfigError` that `main` raises (a flag's value, a config key, a cluster
    tfdist cannot use) prints `<script>: error: <what is wrong and what to do>` on standard
    error, as the `tfdist` command does, and exits with status 2, where `app.run` would
    print a traceback. Every other exception is left to absl.

    Args:
        main: The absl main, called with the arguments absl leaves.
        argv: The command line (None: `sys.argv`).

    Example:

        def main(argv):
            runner = tfdist.Runner.from_flags()
            ...

        if __name__ == "__main__":
            tfdist_flags.run(main)
    """
    def one_line_errors(arguments: list[str]) -> Any:
        try:
            return main(arguments)
        except ConfigError as error:
            for line in error.problems:  # a line for each mistake
                print(f"{os.path.basename(sys.argv[0])}: error: {line}", file=sys.stderr,
                      flush=True)
            sys.exit(2)

    app.run(one_line_errors, argv=None if argv is None else list(argv))
