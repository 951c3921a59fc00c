"""Which of tfdist's refusals of bad input the tests reach, read from a coverage.py run.

A refusal is a place in `tfdist/` that turns bad input away: a `raise` of `ConfigError`
(or of a subclass of it) and an explicit exit with status 2. They are found in the
source, not kept in a list, so a new one is counted the day it is written. One that only
hardware the tests lack can reach says so in a comment on the line above it,
`# Reached only with GPUs ...`: it is listed apart, not counted as missed.

`make refusals` runs the tests under coverage.py (every process they start included, by
`tests/process_count/sitecustomize.py`), then this module, which prints each refusal no
test reached and exits 1 if there is one:

    .venv/bin/python -m tests.refusals .coverage [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "tfdist"
NEEDS = re.compile(r"#\s*Reached only with (\w+)")


@dataclass(frozen=True)
class Refusal:
    path: Path
    line: int
    text: str  # the statement's first line, as written
    needs: str = ""  # what no test machine has, that reaching it takes ("GPUs")

    def __str__(self) -> str:
        where = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{where}:{self.line}: {self.text}"


def _refusing_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """ConfigError and the classes in tfdist that derive from it, by name."""
    names, grew = {"ConfigError"}, True
    while grew:
        grew = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if (isinstance(node, ast.ClassDef) and node.name not in names
                        and any(isinstance(base, ast.Name) and base.id in names
                                for base in node.bases)):
                    names.add(node.name)
                    grew = True
    return names


def _refuses(node: ast.AST, classes: set[str]) -> bool:
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        function = node.exc.func
        if isinstance(function, ast.Attribute):  # ConfigError.of(problems)
            function = function.value
        return isinstance(function, ast.Name) and function.id in classes
    # sys.exit(2) and SystemExit(2): the CLI's status for bad input.
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        function = node.func
        name = function.attr if isinstance(function, ast.Attribute) else getattr(
            function, "id", None)
        return name in ("exit", "SystemExit") and node.args[0].value == 2
    return False


def refusals(package: Path = PACKAGE) -> list[Refusal]:
    """Every refusal in `package`'s source, in file and line order.

    Example:
        >>> any(r.path.name == "config.py" for r in refusals())
        True
    """
    trees = {path: ast.parse(path.read_text(), str(path))
             for path in sorted(package.rglob("*.py"))}
    classes = _refusing_classes(trees)
    found = []
    for path, tree in trees.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if _refuses(node, classes):
                above = NEEDS.search(lines[node.lineno - 2]) if node.lineno > 1 else None
                found.append(Refusal(path, node.lineno, lines[node.lineno - 1].strip(),
                                     above.group(1) if above else ""))
    return sorted(set(found), key=lambda refusal: (str(refusal.path), refusal.line))


def reached_lines(data_file: Path) -> dict[Path, set[int]]:
    """The lines of each file that ran, from a combined coverage.py data file."""
    import coverage

    data = coverage.CoverageData(str(data_file))
    data.read()
    reached: dict[Path, set[int]] = {}
    for name in data.measured_files():
        reached.setdefault(Path(name).resolve(), set()).update(data.lines(name) or ())
    return reached


def unreached(data_file: Path, package: Path = PACKAGE) -> tuple[list[Refusal], list[Refusal]]:
    """(every refusal in `package`, those no line of the run reached: the ones it needs
    hardware for included)."""
    reached = reached_lines(data_file)
    every = refusals(package)
    return every, [r for r in every if r.line not in reached.get(r.path.resolve(), set())]


def main(argv: list[str] | None = None, package: Path = PACKAGE) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data_file", type=Path, help="a combined coverage.py data file")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if not args.data_file.exists():
        print(f"refusals: {args.data_file} does not exist; run `make refusals`, which "
              "writes it", file=sys.stderr)
        return 2
    every, unseen = unreached(args.data_file, package)
    missed = [refusal for refusal in unseen if not refusal.needs]
    needing = [refusal for refusal in unseen if refusal.needs]
    if args.json:
        print(json.dumps({"refusals": len(every), "reached": len(every) - len(unseen),
                          "unreached": [str(r) for r in missed],
                          "needs": {str(r): r.needs for r in needing}}, indent=1))
    else:
        print(f"{len(every) - len(unseen)} of {len(every)} refusals in {package.name}/ were "
              f"reached by the tests; {len(needing)} need what this machine lacks")
        for refusal in needing:
            print(f"  needs {refusal.needs}: {refusal}")
        for refusal in missed:
            print(f"  not reached: {refusal}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
