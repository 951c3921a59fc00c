"""Horovod's own TF2 Keras tests (tests/ported/horovod_tensorflow2_keras.py), ported to
Keras 3, run on tfdist.horovod.keras on 2 ranks under mpirun: each rank runs pytest and
writes its own JUnit XML, which is read here."""

import sys
import xml.etree.ElementTree as ElementTree

import pytest

from tests.conftest import REPO, mpirun, run_command

PORTED = REPO / "tests" / "ported" / "horovod_tensorflow2_keras.py"


@pytest.mark.requires_mpi
@pytest.mark.requires_horovod
@pytest.mark.multiprocess
def test_horovods_tf2_keras_tests_pass_on_2_ranks(tmp_path):
    per_rank = (f"exec {sys.executable} -m pytest -q -p no:cacheprovider {PORTED} "
                f"--junitxml={tmp_path}/rank$OMPI_COMM_WORLD_RANK.xml "
                f"> {tmp_path}/rank$OMPI_COMM_WORLD_RANK.txt 2>&1")
    result = run_command(mpirun("sh", "-c", per_rank), cwd=REPO, timeout=180)
    outputs = {rank: (tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert result.returncode == 0, outputs[0][-3000:] + outputs[1][-3000:]
    for rank in (0, 1):
        cases = ElementTree.parse(tmp_path / f"rank{rank}.xml").getroot().iter("testcase")
        outcome = {case.get("name"): [child.tag for child in case] for case in cases}
        ported = {name: tags for name, tags in outcome.items() if name != "test_session"}
        # Horovod's 11 tests, two of them in two cases each; none skipped, none failed.
        assert len(ported) == 13, outcome
        assert not any({"failure", "error", "skipped"} & set(tags)
                       for tags in ported.values()), (rank, ported)
