"""MkDocs hooks: pages made from the code and the benchmarks, so the site cannot drift.

- `how-it-works/patches.md`: its `<!-- patches:table -->` marker becomes the table of every
  patch in tfdist's registry (name, what goes wrong without it, upstream issue, who applies
  it), from `tfdist.app.cli.patches_report`, what `tfdist env --json` prints.
- `evidence/results.md`: `benchmarks/RESULTS.md` as `make bench` wrote it, with its plots
  (`benchmarks/plots/*.png` served as `evidence/plots/`).
"""

from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, Files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, "benchmarks")
PATCHES_MARKER = "<!-- patches:table -->"


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
    if page.file.src_uri == "how-it-works/patches.md":
        if PATCHES_MARKER not in markdown:
            raise ValueError(f"{page.file.src_uri} lost its {PATCHES_MARKER} marker")
        return markdown.replace(PATCHES_MARKER, patches_table())
    return markdown


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
