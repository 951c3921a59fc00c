"""`make mutants`: deliberate bugs, each applied alone to a copy of the repository, and the
tests that should see it run against that copy. Every bug must be caught.

Each bug is one exact edit of one file, in a place where a real bug could appear: a scale
factor, a slice off by one, a collective skipped, a local rank for a global one, a state
left out, a refusal removed. The copy holds the repository's files (with any uncommitted
changes) and links the environment; PYTHONPATH names the copy, so the tests and every
process they start import the mutated tfdist. An edit whose text is not found once fails
the run: the list follows the code, or it says so.

    .venv/bin/python scripts/mutants.py                 # all, one after another
    .venv/bin/python scripts/mutants.py --only adasum_averaged --only zero_sum_not_mean
    .venv/bin/python scripts/mutants.py --list

Run before a release, not by CI: each bug reruns the tests that vouch for its code, after
each distinct set of those tests has run once on the code as it is, which must pass (a
test failing there would count every bug as caught). It prints a line per run: for each
bug, caught or MISSED, the first failing test, and the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One deliberate bug: `before` replaced by `after` in `path`, which `tests` must see."""

    name: str
    what: str
    path: str
    before: str
    after: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("zero_sum_not_mean", "stages 2-3 sum each weight's gradient over ranks",
           "tfdist/horovod/collectives.py",
           "self._hvd.reducescatter, flat, op=self._hvd.Average,",
           "self._hvd.reducescatter, flat, op=self._hvd.Sum,",
           ("tests/adapters/test_zero.py", "-k", "two_ranks_equal_one_device")),
    Mutant("zero_slice_one_short",
           "stages 2-3: each rank's slice of a variable (what it stores, updates and "
           "checkpoints) ends one element early", "tfdist/sharding/layout.py",
           "return start, min(start + self.width, self.size)",
           "return start, min(start + self.width - 1, self.size)",
           ("tests/test_sharding.py", "-k", "slicing or layout_says or cut_each")),
    Mutant("zero3_units_never_regather",
           "stage 3: no layer's call gathers and drops its weights (each gathered weight "
           "held to the backward: the whole model at the peak)", "tfdist/sharding/units.py",
           "or self.state is UnitState.GATHERED or not self.recomputed):",
           "or self.state is UnitState.GATHERED or bool(layer.trainable_variables)):",
           ("tests/test_units.py", "-k", "gathered_twice")),
    Mutant("zero3_recompute_outside_keras_call_state",
           "stage 3: the backward's recompute of a layer reads its weights in float32 "
           "under a mixed policy", "tfdist/sharding/units.py",
           "with tf.GradientTape() as tape, keras_state():",
           "with tf.GradientTape() as tape:",
           ("tests/test_units.py", "-k", "mixed_float16")),
    Mutant("zero3_built_in_fit_without_creation_scope",
           "stage 3: a model built on its first batch in fit is built whole (its weights "
           "not slices, its layers no units)", "tfdist/patches/keras_trainer.py",
           "        with optimizer.creation_scope(self):",
           "        if True:  # no creation scope",
           ("tests/test_units.py", "-k", "first_batch")),
    Mutant("zero3_orphan_weights_join_no_unit",
           "stage 3: a weight Keras creates after its layer's build (a subclassed model "
           "built by a call) joins the outer layer's unit, or none",
           "tfdist/sharding/weights.py",
           "            owners.update({id(held(variable)): layer for variable in weights})",
           "            owners.update({id(held(variable)): root for variable in "
           "root.trainable_variables})",
           ("tests/test_units.py", "-k", "first_batch")),
    Mutant("zero3_update_before_every_gradient",
           "stage 3: a slice's update waits for its own gradient alone, so a recompute's "
           "read of a nested unit's slice may run after that slice's update",
           "tfdist/sharding/optimizer.py", "            mine = after_every_gradient(mine, again)",
           "            mine = list(mine)",
           ("tests/test_units.py", "-k", "every_read")),
    Mutant("horovod_batch_check_removed", "horovod trains a batch that does not divide",
           "tfdist/adapters/horovod.py",
           "        check_global_batch_size(global_batch_size, size)\n"
           "        if not isinstance(source, tf.data.Dataset):",
           "        if not isinstance(source, tf.data.Dataset):",
           ("tests/adapters/test_horovod.py", "-k", "divide")),
    Mutant("horovod_local_rank_slices", "each rank slices the batch by its local rank",
           "tfdist/adapters/horovod.py",
           "size, rank = self.hvd.size(), self.hvd.rank()",
           "size, rank = self.hvd.size(), self.hvd.local_rank()",
           ("tests/adapters/test_horovod.py", "-k", "two_hosts")),
    Mutant("horovod_local_size_scales_rate", "the learning rate scales by the local size",
           "tfdist/adapters/horovod.py",
           "schedule = ScaledWarmup(learning_rate, multiplier=self.hvd.size(),",
           "schedule = ScaledWarmup(learning_rate, multiplier=self.hvd.local_size(),",
           ("tests/adapters/test_horovod.py", "-k", "two_hosts")),
    Mutant("adasum_averaged", "horovod.op adasum averages instead",
           "tfdist/adapters/horovod.py",
           "Reduction.ADASUM: hvd.Adasum}[options.op]",
           "Reduction.ADASUM: hvd.Average}[options.op]",
           ("tests/adapters/test_horovod.py", "-k", "adasum")),
    Mutant("horovod_last_gradient_kept_local", "the last gradient is not reduced",
           "tfdist/optimizers.py",
           "for index, grad in zip(present, reduced):",
           "for index, grad in zip(present[:-1], reduced):",
           ("tests/adapters/test_horovod.py", "-k", "every_rank_equals_one_device")),
    Mutant("accumulation_sums", "accumulated gradients are summed, not averaged, over K",
           "tfdist/accumulation.py",
           "scale = 1.0 / self.steps if self.average else 1.0",
           "scale = 1.0",
           ("tests/test_accumulation.py", "-k", "k_micro_batches")),
    Mutant("loss_scale_not_agreed", "each rank decides alone whether to skip an fp16 step",
           "tfdist/optimizers.py",
           "self.finite_reduce_fn = finite_reduce_fn",
           "self.finite_reduce_fn = None",
           ("tests/adapters/test_horovod.py", "-k", "mixed_float16")),
    Mutant("resume_skips_a_step_more", "a resume skips one step past the checkpoint",
           "tfdist/resume/backup.py",
           "self._resume_epoch, self._skip = position.epoch, position.step",
           "self._resume_epoch, self._skip = position.epoch, position.step + 1",
           ("tests/resume/test_backup.py", "-k", "sigkill_mid_epoch")),
    Mutant("multi_worker_batch_check_removed", "multi_worker trains a batch that does not divide",
           "tfdist/adapters/multi_worker.py",
           "        check_global_batch_size(global_batch_size, strategy.num_replicas_in_sync)\n",
           "",
           ("tests/adapters/test_multi_worker.py", "-k", "does_not_divide")),
    Mutant("parameter_server_workers_share_a_shard", "every worker reads the same shard",
           "tfdist/adapters/parameter_server/coordinated_fit.py",
           "return copy.shard(num_workers, slot % num_workers).repeat()",
           "return copy.shard(num_workers, 0).repeat()",
           ("tests/adapters/test_parameter_server.py",)),
    Mutant("checkpoint_without_optimizer", "a checkpoint leaves the optimizer's state out",
           "tfdist/resume/backup.py",
           "    if model.optimizer is not None:\n"
           "        objects[\"optimizer\"] = model.optimizer\n",
           "",
           ("tests/resume/test_backup.py", "-k", "sigkill_mid_epoch")),
    Mutant("mirrored_zero_refusal_removed", "mirrored takes zero_stage without a word",
           "tfdist/adapters/mirrored.py",
           "    zero_refusal = (\"Keras's optimizer",
           "    zero_refusal = None and (\"Keras's optimizer",
           ("tests/test_bad_input.py", "-k", "zero")),
]


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    return [name for name in listed if name and (REPO / name).is_file()]


def copy_with(mutant: Mutant | None, folder: Path) -> None:
    """The repository's files in `folder`, the environment linked, `mutant` applied."""
    for name in tracked_files():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, folder / name)
    (folder / ".venv").symlink_to(REPO / ".venv")
    if mutant is None:
        return
    target = folder / mutant.path
    text = target.read_text()
    found = text.count(mutant.before)
    if found != 1:
        raise SystemExit(f"mutants: {mutant.name}: the text to change is in {mutant.path} "
                         f"{found} times, not once; update the list to the code")
    target.write_text(text.replace(mutant.before, mutant.after))


def run(mutant: Mutant | None, tests: tuple[str, ...]) -> tuple[str, str, float]:
    """`tests` against a copy with `mutant` applied (None: the code as it is): (caught |
    MISSED | error, the first failing test or what went wrong, seconds)."""
    started = time.monotonic()
    name = mutant.name if mutant else "control"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as folder:
        copy_with(mutant, Path(folder))
        env = {**os.environ, "PYTHONPATH": folder, "TF_CPP_MIN_LOG_LEVEL": "2"}
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", "--require-all", *tests],
                              cwd=folder, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)
    if done.returncode == 1 and failed:
        return "caught", failed.group(1), seconds
    if done.returncode == 0:
        return "MISSED", f"{' '.join(tests)}: all passed", seconds
    return "error", output.strip().splitlines()[-1] if output.strip() else "no output", seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTANTS])
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.what} ({mutant.path}; {' '.join(mutant.tests)})")
        return 0
    # First each distinct selection of tests on the code as it is: a test that fails there
    # would count every bug as caught.
    failing = set()
    width = max(len(mutant.name) for mutant in chosen)  # the names' column
    for tests in dict.fromkeys(mutant.tests for mutant in chosen):
        verdict, detail, seconds = run(None, tests)
        print(f"{'passes' if verdict == 'MISSED' else 'FAILS':6} {'(no bug)':{width}} "
              f"{seconds:6.0f} s  {' '.join(tests)}", flush=True)
        if verdict != "MISSED":
            failing.add(tests)
    missed = 0
    for mutant in chosen:
        if mutant.tests in failing:
            verdict, detail, seconds = "error", "its tests fail without the bug", 0.0
        else:
            verdict, detail, seconds = run(mutant, mutant.tests)
        missed += verdict != "caught"
        print(f"{verdict:6} {mutant.name:{width}} {seconds:6.0f} s  {detail}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
