"""The map, checked: the rules docs/develop/layout.md states, read from the code itself.

Each rule is read from the imports (ast) of every module under tfdist/, wherever they sit
(a function's body counts too), and from every read of the environment. Each rule's test
also runs the same check on a deliberate violation, so a check that cannot fail is seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TFDIST = Path(__file__).resolve().parents[1] / "tfdist"


def module_name(path: Path) -> str:
    parts = path.relative_to(TFDIST.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str) -> set[str]:
    """The tfdist names `source` imports, dotted (`from a import b` gives a and a.b).

    tfdist imports absolutely only (a test below keeps it so), so no relative import
    needs resolving.
    """
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "tfdist" or name.startswith("tfdist.")}


def reads_environment(source: str) -> bool:
    """Whether `source` reads os.environ or os.getenv."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv") for alias in node.names):
            return True
    return False


def modules() -> dict[str, str]:
    """Every module of the library: dotted name -> source."""
    return {module_name(path): path.read_text() for path in sorted(TFDIST.rglob("*.py"))}


def adapter_of(module: str) -> str | None:
    """The adapter a module belongs to (`tfdist.adapters.<name>`), or None."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "adapters" or parts[2] in ("base", "__init__"):
        return None
    return parts[2]


# --- the rules: each returns its violations as "module -> what" lines ----------------------


def adapters_import_each_other(library: dict[str, str]) -> list[str]:
    found = []
    for module, source in library.items():
        own = adapter_of(module)
        if own is None:
            continue
        for name in imported(source):
            other = adapter_of(name)
            if other is not None and other != own:
                found.append(f"{module} -> {name}")
    return found


def patches_import_above_them(library: dict[str, str]) -> list[str]:
    # patches/ is a leaf: it fixes Keras, TensorFlow and Horovod, and is handed whatever
    # of tfdist it needs when it is applied. tfdist.errors is below everything.
    allowed = ("tfdist.patches", "tfdist.errors")
    return [f"{module} -> {name}" for module, source in library.items()
            if module.startswith("tfdist.patches")
            for name in imported(source)
            if name != "tfdist" and not name.startswith(allowed)]


def environment_read_outside_cluster(library: dict[str, str]) -> list[str]:
    return [module for module, source in library.items()
            if module != "tfdist.cluster" and reads_environment(source)]


def library_imports_the_app(library: dict[str, str]) -> list[str]:
    return [f"{module} -> {name}" for module, source in library.items()
            if not module.startswith("tfdist.app")
            for name in imported(source) if name.startswith("tfdist.app")]


def horovod_code_outside_its_wing(library: dict[str, str]) -> list[str]:
    # Horovod-only code lives under tfdist/horovod/; outside it, only the horovod adapter
    # reaches in.
    return [f"{module} -> {name}" for module, source in library.items()
            if not module.startswith(("tfdist.horovod", "tfdist.adapters.horovod"))
            for name in imported(source) if name.startswith("tfdist.horovod")]


def model_parallel_patches_applied_outside_placement(library: dict[str, str]) -> list[str]:
    # tfdist.parallel's patches are applied where every parallel layer gets its devices
    # (placement.resolve_devices), and nowhere else.
    return [module for module, source in library.items()
            if module != "tfdist.parallel.placement" and "MODEL_PARALLEL)" in source
            and "patches.apply(" in source]


def model_devices_set_outside_the_base(library: dict[str, str]) -> list[str]:
    # The adapter base computes the model's devices once; no adapter sets them as a side
    # effect of building its strategy.
    found = []
    for module, source in library.items():
        if module == "tfdist.adapters.base":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Assign) and any(
                    isinstance(target, ast.Attribute) and target.attr == "model_devices"
                    and isinstance(target.value, ast.Name) and target.value.id == "self"
                    for target in node.targets) and module.startswith("tfdist.adapters"):
                found.append(module)
    return found


def micro_batch_check_outside_dataset_checks(library: dict[str, str]) -> list[str]:
    # What runner.dataset refuses is said in tfdist/dataset_checks.py.
    return [module for module, source in library.items()
            if module != "tfdist.dataset_checks"
            and "must divide each replica's batch" in source]


def keras_storage_touched_outside_the_hooks(library: dict[str, str]) -> list[str]:
    # What a Keras variable holds (its private `_value`) is read and replaced, with an
    # undo, in tfdist.sharding.hooks alone; tfdist's patches of Keras are the other code
    # that knows Keras's insides, each checked against the installed source.
    return [module for module, source in library.items()
            if module != "tfdist.sharding.hooks" and not module.startswith("tfdist.patches")
            and any(isinstance(node, ast.Attribute) and node.attr == "_value"
                    for node in ast.walk(ast.parse(source)))]


RULES = [adapters_import_each_other, patches_import_above_them,
         environment_read_outside_cluster, library_imports_the_app,
         horovod_code_outside_its_wing, model_parallel_patches_applied_outside_placement,
         model_devices_set_outside_the_base, micro_batch_check_outside_dataset_checks,
         keras_storage_touched_outside_the_hooks]

# One deliberate violation of each rule, added to the real library.
VIOLATIONS = {
    adapters_import_each_other: ("tfdist.adapters.mirrored",
                                 "from tfdist.adapters.horovod import HorovodAdapter\n"),
    patches_import_above_them: ("tfdist.patches.keras_trainer",
                                "def f():\n    from tfdist.runner import Runner\n"),
    environment_read_outside_cluster: ("tfdist.runner", "import os\nx = os.environ.get('X')\n"),
    library_imports_the_app: ("tfdist.runner", "from tfdist.app import cli\n"),
    horovod_code_outside_its_wing: ("tfdist.runner",
                                    "from tfdist.horovod import collectives\n"),
    model_parallel_patches_applied_outside_placement: (
        "tfdist.parallel.pipeline", "def f():\n    patches.apply(patches.MODEL_PARALLEL)\n"),
    model_devices_set_outside_the_base: (
        "tfdist.adapters.one_device", "def f(self):\n    self.model_devices = ()\n"),
    micro_batch_check_outside_dataset_checks: (
        "tfdist.runner", "X = \"must divide each replica's batch\"\n"),
    keras_storage_touched_outside_the_hooks: (
        "tfdist.sharding.optimizer", "def f(variable):\n    return variable._value.shard\n"),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_library_keeps_the_rule(rule):
    assert rule(modules()) == []


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_the_rule_catches_a_deliberate_violation(rule):
    library = modules()
    module, violation = VIOLATIONS[rule]
    library[module] = library[module] + "\n" + violation
    assert rule(library) and all(module in line for line in rule(library))


def test_the_library_imports_absolutely():
    relative = [module for module, source in modules().items()
                for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []


def test_import_tfdist_alone_reaches_parallel_and_sharding_and_loads_no_tensorflow():
    # `import tfdist` stays light (the CLI sets TensorFlow's log level before TensorFlow
    # loads); the subpackages load when first reached, as `tfdist.Runner` does.
    import subprocess
    import sys

    code = ("import sys, tfdist\n"
            "assert 'tensorflow' not in sys.modules\n"
            "print(tfdist.parallel.Pipeline.__name__, tfdist.sharding.state_bytes.__name__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["Pipeline", "state_bytes"]
