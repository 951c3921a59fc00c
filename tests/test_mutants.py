"""`make mutants`' list follows the code: each deliberate bug's text is in its file once, so
the release's run applies every bug (scripts/mutants.py runs them; CI does not)."""

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import mutants  # noqa: E402


def test_every_deliberate_bug_applies_to_the_code_as_it_is():
    assert len(mutants.MUTANTS) >= 12
    assert len({mutant.name for mutant in mutants.MUTANTS}) == len(mutants.MUTANTS)
    for mutant in mutants.MUTANTS:
        assert (REPO / mutant.path).read_text().count(mutant.before) == 1, mutant.name
        assert mutant.before != mutant.after and mutant.tests, mutant.name
        assert (REPO / mutant.tests[0]).is_file(), mutant.name
