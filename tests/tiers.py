"""The first tier: the tests `make test` runs beyond the unit tier, one real run for each
strategy and each technique. `make test-all` runs every test, these included.

`tests/conftest.py` marks each test named here `first_tier`; the Makefile selects
`first_tier or (the unit tier)`. `tests/test_suite.py` checks that every strategy tfdist
registers and every technique below has a test here, that each one named exists and
starts processes, and that the Makefile's selection is the one described here.

Choosing one (docs/develop/tests.md, "Tiers"): the cheapest test that runs the strategy or
technique for real, in processes, against one device; a test whose module trains its
variants in one shared launch brings that launch with it, so pick one whose launch is
small.

    from tests.tiers import FIRST_TIER
    FIRST_TIER["preemption"]   # the node ids that cover it
"""

from __future__ import annotations

# What must have a first-tier test: each strategy in tfdist's registry (but those in
# NO_FIRST_TIER_RUN) and each technique.
TECHNIQUES = ("accumulation", "zero_stage 1", "zero_stage 2", "zero_stage 3",
              "a model larger than one device", "pipeline", "resume after a kill", "preemption",
              "the README as written")

# Strategies no multi-process test can run here, and why.
NO_FIRST_TIER_RUN = {
    "tpu": "no TPU here: its code paths that need none run in the unit tier "
           "(tests/adapters/test_tpu.py)",
    "one_device": "a single device in one process: every equivalence test compares with it, "
                  "in the unit tier too",
}

TWO_EMBEDDINGS = "tests/adapters/test_two_embeddings.py::test_horovod_equals_one_device"

# Strategy or technique -> the tests that run it (pytest node ids).
FIRST_TIER: dict[str, list[str]] = {
    "mirrored": ["tests/test_cli.py::test_train_as_make_demo_runs_it"],
    "multi_worker": ["tests/adapters/test_multi_worker.py::test_equals_one_device[0-sgd-2-0]"],
    "parameter_server": ["tests/adapters/test_parameter_server.py::"
                         "test_one_worker_equals_one_device_and_counts_every_step"],
    "horovod": [f"{TWO_EMBEDDINGS}[pair-s0_acc1]"],
    "accumulation": ["tests/adapters/test_multi_worker.py::"
                     "test_accumulating_4_micro_batches_equals_one_device[sgd]",
                     f"{TWO_EMBEDDINGS}[pair-s0_acc2]"],
    # The pair's 8 variants (stages 0-3, accumulation 1 and 2) train in one launch.
    "zero_stage 1": [f"{TWO_EMBEDDINGS}[pair-s1_acc1]", f"{TWO_EMBEDDINGS}[pair-s1_acc2]"],
    "zero_stage 2": [f"{TWO_EMBEDDINGS}[pair-s2_acc1]", f"{TWO_EMBEDDINGS}[pair-s2_acc2]"],
    "zero_stage 3": [f"{TWO_EMBEDDINGS}[pair-s3_acc1]", f"{TWO_EMBEDDINGS}[pair-s3_acc2]"],
    # 8 ranks under a memory cap below the model's weights (its reference run comes along).
    "a model larger than one device": ["tests/test_larger_than_device.py::test_under_the_cap_"
                                       "stage_3_trains_on_8_ranks_equal_to_the_uncapped_"
                                       "device[mlp]"],
    "pipeline": ["tests/adapters/test_model_parallel.py::"
                 "test_every_rank_equals_one_device_on_the_global_batch[pipeline]"],
    "resume after a kill": ["tests/resume/test_backup.py::"
                            "test_sigkill_mid_epoch_resumes_at_the_step_after_the_checkpoint"
                            "[multi_worker]"],
    "preemption": ["tests/resume/test_backup.py::"
                   "test_sigterm_to_one_worker_stops_both_at_one_step_and_resumes[worker1]"],
    "the README as written": ["tests/test_docs.py::test_a_page_runs_as_written[README.md]"],
}


def first_tier_tests() -> set[str]:
    """Every node id FIRST_TIER names."""
    return {test for tests in FIRST_TIER.values() for test in tests}


def listed_id(item) -> str:
    """A collected test's node id as FIRST_TIER lists it (file::name[params]), built from its
    parts: pytest-xdist's workers append `@GROUP` to the node id of a test in an
    `xdist_group` (--dist loadgroup) before a conftest sees it.

    Args:
        item: A `pytest.Item` (a test function of a module).
    """
    return f"{item.nodeid.split('::', 1)[0]}::{item.name}"
