"""MkDocs hooks: pages made from the code and the benchmarks, so the site cannot drift.

- `how-it-works/patches.md`: its `<!-- patches:table -->` marker becomes the table of every
  patch in tfdist's registry (name, what goes wrong without it, upstream issue, who applies
  it), from `tfdist.app.cli.patches_report`, what `tfdist env --json` prints.
- `evidence/benchmarks.md`: its `<!-- benchmarks:table -->` marker becomes the table of
  the benchmarks `make bench` runs, in its order, each with its docstring's first paragraph.
- `develop/tests.md`: its `<!-- test-costs:table -->` marker becomes what a whole test run
  spent, per module (`docs/develop/test-costs.json`, written by `python -m tests.costs
  REPORT --json` from a `make test-all` run's `.test-costs.jsonl`).
- `evidence/results.md`: `benchmarks/RESULTS.md` as `make bench` wrote it, with its plots
  (`benchmarks/plots/*.png` served as `evidence/plots/`).
"""

from __future__ import annotations

import ast
import os
import re

from mkdocs.structure.files import File, Files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
PATCHES_MARKER = "<!-- patches:table -->"
BENCHMARKS_MARKER = "<!-- benchmarks:table -->"
TEST_COSTS_MARKER = "<!-- test-costs:table -->"


def on_files(files: Files, config) -> Files:
    files.append(File.generated(config, "evidence/results.md",
                                abs_src_path=os.path.join(BENCHMARKS, "RESULTS.md")))
    plots = os.path.join(BENCHMARKS, "plots")
    for name in sorted(os.listdir(plots)):
        if name.endswith(".png"):
            files.append(File.generated(config, f"evidence/plots/{name}",
                                        abs_src_path=os.path.join(plots, name)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    generated = {"how-it-works/patches.md": (PATCHES_MARKER, patches_table),
                 "evidence/benchmarks.md": (BENCHMARKS_MARKER, benchmarks_table),
                 "develop/tests.md": (TEST_COSTS_MARKER, test_costs_table)}
    if page.file.src_uri in generated:
        marker, table = generated[page.file.src_uri]
        if marker not in markdown:
            raise ValueError(f"{page.file.src_uri} lost its {marker} marker")
        return markdown.replace(marker, table())
    return markdown


def test_costs_table(shown: int = 15) -> str:
    """The measured run's totals, then its `shown` costliest modules."""
    import json

    with open(os.path.join(REPO, "docs", "develop", "test-costs.json")) as stream:
        costs = json.load(stream)
    counted = costs["processes"] > 0  # a report from before processes were counted has none
    started = (f"; the tests started {costs['processes']} Python processes, "
               f"{costs['tensorflow_processes']} of them with TensorFlow" if counted else "")
    rows = [f"{costs['measured']}: {costs['cpu_s']:,.0f} CPU-s in {costs['tests']} tests"
            f"{started}.", "",
            "| module | tests |" + (" processes |" if counted else "") + " CPU seconds | share |",
            "|---|---|" + ("---|" if counted else "") + "---|---|"]

    def row(name, tests, processes, cpu_s, share):
        return (f"| {name} | {tests} |" + (f" {processes} |" if counted else "") +
                f" {cpu_s:,.0f} | {share:.0%} |")

    for module in costs["modules"][:shown]:
        rows.append(row(f"`{module['module']}`", module["tests"], module["processes"],
                        module["cpu_s"], module["share"]))
    rest = costs["modules"][shown:]
    if rest:
        rows.append(row(f"{len(rest)} other modules", *(sum(r[key] for r in rest) for key in (
            "tests", "processes", "cpu_s", "share"))))
    return "\n".join(rows)


def benchmarks_table() -> str:
    """Each benchmark `make bench` runs (`report.BENCHMARKS`, in its order), with what its
    docstring's first paragraph says it measures."""
    with open(os.path.join(BENCHMARKS, "report.py")) as stream:
        report = ast.parse(stream.read())
    names = next(ast.literal_eval(node.value) for node in report.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") ==
                 "BENCHMARKS")
    rows = ["| script | what it measures |", "|---|---|"]
    for name in names:
        with open(os.path.join(BENCHMARKS, f"{name}.py")) as stream:
            docstring = ast.get_docstring(ast.parse(stream.read())) or ""
        summary = " ".join(docstring.split("\n\n")[0].split())
        if not summary:
            raise ValueError(f"benchmarks/{name}.py has no docstring to describe it")
        rows.append(f"| `{name}.py` | {summary} |")
    return "\n".join(rows)


def patches_table() -> str:
    import tfdist.quiet

    tfdist.quiet.start_quietly()  # TensorFlow's start-up log off the build's output.
    from tfdist.app.cli import patches_report

    rows = ["| patch | what goes wrong without it | upstream | applied by |",
            "|---|---|---|---|"]
    for patch in patches_report(check_bugs=False)["all"]:
        rows.append(f"| `{patch['name']}` | {patch['summary']} | {_linked(patch['upstream'])} "
                    f"| {', '.join(f'`{user}`' for user in patch['applied_by'])} |")
    return "\n".join(rows)


def _linked(upstream: str) -> str:
    """`owner/repo#N` as a link to the issue; anything else (why there is none) as it is."""
    return re.sub(r"\b([\w.-]+)/([\w.-]+)#(\d+)\b",
                  r"[\1/\2#\3](https://github.com/\1/\2/issues/\3)", upstream)
