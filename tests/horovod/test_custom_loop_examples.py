"""Horovod's own custom-loop examples (tests/ported/tensorflow2_*.py, Horovod 0.28.1's
examples/tensorflow2, kept verbatim) on `tfdist.horovod.tensorflow`, under real mpirun.

A user changes two lines: the import, and `opt.variables()` -> `opt.variables` (Keras 3
made it a property). The other changes below are this test's, each said why: data made
here instead of downloaded, a run short enough for a test, and what the comparison with
one device needs (one seed, float64, no dropout). Each change must match the upstream
text exactly once, so an edit upstream is seen, not silently skipped.
"""

import json
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, mpirun, run_command
from tests.reference import mnist_like

pytestmark = [pytest.mark.requires_mpi, pytest.mark.requires_horovod, pytest.mark.multiprocess]

PORTED = REPO / "tests" / "ported"
STEPS, BATCH, SEED = 6, 32, 5

# What a Horovod user changes for Keras 3 (the "coming from Horovod" page lists them).
USER_CHANGES = [
    ("import horovod.tensorflow as hvd", "import tfdist.horovod.tensorflow as hvd"),
    ("opt.variables()", "opt.variables"),
]

MNIST_CHANGES = USER_CHANGES + [
    # No network here: digits-like images made by tests.reference, the same on every rank.
    ("import horovod\n", ("import horovod\nimport keras, numpy as np\n"
                          f"sys.path.insert(0, {str(REPO)!r})\n"
                          "from tests.reference import mnist_like\n")),
    ("tf.keras.datasets.mnist.load_data(path='mnist-%d.npz' % hvd.rank())", "mnist_like()"),
    # One device is compared in float64 (Adam turns float32 rounding into 1e-5..2e-4), from
    # one seed on every rank (Horovod's broadcast comes after the first step).
    ("    hvd.init()\n",
     f"    hvd.init()\n    keras.config.set_floatx('float64')\n"
     f"    keras.utils.set_random_seed({SEED})\n"),
    # Each rank's own order, which one device can replay; a short run, small batches.
    ("dataset.repeat().shuffle(10000).batch(128)",
     f"dataset.repeat().shuffle(10000, seed=hvd.rank()).batch({BATCH})"),
    ("dataset.take(10000 // hvd.size())", f"dataset.take({STEPS})"),
    # A dropout mask is drawn per example: one device would draw other masks.
    ("tf.keras.layers.Dropout(0.25)", "tf.keras.layers.Dropout(0.0)"),
    ("tf.keras.layers.Dropout(0.5)", "tf.keras.layers.Dropout(0.0)"),
    # Every rank's weights, to compare.
    ("    if hvd.rank() == 0:\n        checkpoint.save(checkpoint_dir)",
     "    np.savez('rank%d.npz' % hvd.rank(), *mnist_model.get_weights())\n"
     "    if hvd.rank() == 0:\n        checkpoint.save(checkpoint_dir)"),
]

BENCHMARK_CHANGES = USER_CHANGES + [
    # A model and images small enough for a test on a CPU.
    ("[args.batch_size, 224, 224, 3]", "[args.batch_size, 32, 32, 3]"),
    ("(weights=None)", "(weights=None, input_shape=(32, 32, 3))"),
]


def changed(source, changes):
    for old, new in changes:
        assert source.count(old) == 1, f"upstream text changed: {old!r}"
        source = source.replace(old, new)
    return source


def run_ranks(tmp_path, script, processes, *args, timeout=180):
    """Runs `script` on `processes` ranks; each rank's output in tmp_path/out<R>.txt."""
    per_rank = (f'exec {sys.executable} {script} {" ".join(args)} '
                f'> {tmp_path}/out$OMPI_COMM_WORLD_RANK.txt 2>&1')
    result = run_command(mpirun("sh", "-c", per_rank, processes=processes), cwd=tmp_path,
                         timeout=timeout)
    outputs = {r: (tmp_path / f"out{r}.txt").read_text() for r in range(processes)}
    assert result.returncode == 0, {r: text[-3000:] for r, text in outputs.items()}
    return outputs


def one_device_weights(processes):
    """The example's model trained on one device: at step i, the ranks' batches i joined
    (rank order), Adam at the example's rate for that many ranks, float64."""
    floatx = keras.config.floatx()
    keras.config.set_floatx("float64")
    try:
        keras.utils.set_random_seed(SEED)
        (images, labels), _ = mnist_like()
        dataset = tf.data.Dataset.from_tensor_slices(
            (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64)))
        per_rank = [list(dataset.repeat().shuffle(10000, seed=r).batch(BATCH).take(STEPS))
                    for r in range(processes)]
        model = keras.Sequential([
            keras.layers.Conv2D(32, [3, 3], activation="relu"),
            keras.layers.Conv2D(64, [3, 3], activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Dropout(0.0),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.0),
            keras.layers.Dense(10, activation="softmax")])
        loss = keras.losses.SparseCategoricalCrossentropy()
        optimizer = keras.optimizers.Adam(0.001 * processes)
        for step in range(STEPS):
            batch = [tf.concat([per_rank[r][step][part] for r in range(processes)], 0)
                     for part in (0, 1)]
            with tf.GradientTape() as tape:
                value = loss(batch[1], model(batch[0], training=True))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return model.get_weights()
    finally:
        keras.config.set_floatx(floatx)


def rank_weights(tmp_path, rank):
    saved = np.load(tmp_path / f"rank{rank}.npz")
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.mark.parametrize("processes", [2, 3])
def test_horovods_tf2_mnist_example_equals_one_device(processes, tmp_path):
    script = tmp_path / "tensorflow2_mnist.py"
    script.write_text(changed((PORTED / "tensorflow2_mnist.py").read_text(), MNIST_CHANGES))
    outputs = run_ranks(tmp_path, script, processes)
    assert "Step #0\tLoss:" in outputs[0] and "Loss:" not in outputs[1]
    ranks = [rank_weights(tmp_path, r) for r in range(processes)]
    for other in ranks[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(ranks[0], other))
    expected = one_device_weights(processes)
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(ranks[0], expected))
    assert ranks[0][0].dtype == np.float64 and difference < 1e-9, difference
    # Rank 0 alone saved the example's checkpoint.
    assert (tmp_path / "checkpoints-1.index").exists()


def test_horovods_tf2_synthetic_benchmark_example_reports_images_per_second(tmp_path):
    script = tmp_path / "tensorflow2_synthetic_benchmark.py"
    script.write_text(changed((PORTED / "tensorflow2_synthetic_benchmark.py").read_text(),
                              BENCHMARK_CHANGES))
    outputs = run_ranks(tmp_path, script, 2, "--no-cuda", "--model=MobileNet",
                        "--batch-size=4", "--num-warmup-batches=1",
                        "--num-batches-per-iter=2", "--num-iters=2")
    total = re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+) \+-", outputs[0])
    per_device = re.search(r"Img/sec per CPU: ([0-9.]+) \+-", outputs[0])
    assert total and per_device, outputs[0][-2000:]
    assert float(total.group(1)) == pytest.approx(2 * float(per_device.group(1)), rel=0.01)
    assert float(per_device.group(1)) > 0
    assert "img/sec" not in outputs[1]  # rank 1 logs nothing


def test_the_module_has_every_public_name_of_horovod_tensorflow():
    import inspect

    import horovod.tensorflow as horovod_tensorflow

    import tfdist.horovod.tensorflow as hvd

    names = hvd.public_names()
    assert {"DistributedGradientTape", "PartialDistributedGradientTape", "broadcast_variables",
            "allreduce", "allgather", "broadcast", "Compression", "size", "rank",
            "grouped_allreduce", "reducescatter", "broadcast_object"} <= set(names)

    def parameters(function):
        return [(p.name, p.kind, p.default)
                for p in inspect.signature(function).parameters.values()]

    for name in names:
        ours, theirs = getattr(hvd, name), getattr(horovod_tensorflow, name)
        if name in ("init", "DistributedOptimizer"):  # tfdist's own, Horovod's parameters
            assert parameters(ours) == parameters(theirs), name
        else:
            assert ours is theirs, name
    with pytest.raises(AttributeError):
        hvd.no_such_name


def test_importing_it_changes_nothing_until_init(tmp_path):
    # A process of its own: this one's patches depend on the tests run before.
    code = ("import json, tfdist.horovod.tensorflow as hvd, tfdist.patches as p; "
            "before = p.active(); hvd.init(); print(json.dumps([before, p.active()]))")
    result = run_command([sys.executable, "-c", code], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert before == [] and "horovod.tensorflow.broadcast_variables_keras_variables" in after
