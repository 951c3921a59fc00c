"""The preset configs that ship with tfdist: one YAML file per strategy.

`--config mirrored` (or `load_config("mirrored")`) reads `mirrored.yaml` from here,
from any folder and from an installed wheel; a path to a YAML file of your own works
as ever. Copy a preset to start one: `tfdist.presets.path("multi_worker")`.

Example:

    from tfdist import presets

    presets.names()             # ['auto', 'horovod', 'mirrored', ...]
    presets.path("mirrored")    # .../tfdist/presets/mirrored.yaml
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def names() -> list[str]:
    """Every preset's name, sorted."""
    return sorted(entry.name[:-len(".yaml")] for entry in resources.files(__name__).iterdir()
                  if entry.name.endswith(".yaml"))


def path(name: str) -> Path | None:
    """The file of the preset called `name`, or None if there is none.

    Args:
        name: A preset's name, such as "mirrored" (not a path, no ".yaml").
    """
    if name not in names():
        return None
    return Path(str(resources.files(__name__).joinpath(f"{name}.yaml")))
