"""Model parallelism in one process over 2 logical CPU devices (tests/conftest.py splits
the CPU): a Pipeline and a Column/RowParallelDense pair equal plain one-device Keras,
and TensorFlow's own placement record puts each part's forward and backward ops, its
variables and its Adam state on its device."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfdist
from tfdist.parallel import (ColumnParallelDense, ParallelMultiHeadAttention, Pipeline,
                             RowParallelDense, balanced_cut)
from tfdist.patches import keras_optimizer
from tests.reference import largest_difference

TOLERANCE = 1e-5
DEVICES = ("/device:CPU:0", "/device:CPU:1")
FEATURES, OUTPUTS, BATCH, STEPS = 8, 4, 16, 4


def dense_layers(count=4, units=16):
    return [keras.layers.Dense(units, activation="relu", name=f"block{i}")
            for i in range(count - 1)] + [keras.layers.Dense(OUTPUTS, name="head")]


def examples(steps=STEPS, batch=BATCH):
    rng = np.random.RandomState(0)
    return (rng.randn(steps * batch, FEATURES).astype("float32"),
            rng.randn(steps * batch, OUTPUTS).astype("float32"))


def runner_for(**overrides):
    return tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "one_device", "precision": "float32", "model_parallel.devices": 2,
        **overrides}))


def train(runner, model, batch=BATCH, epochs=2, compile=True, optimizer="adam"):
    """Compiles `model` (built already) with Adam (or SGD) inside `runner.scope()`, and fits
    it on the examples in order."""
    if compile:
        made = (keras.optimizers.Adam(0.01) if optimizer == "adam"
                else keras.optimizers.SGD(0.05))
        with runner.scope():
            model.compile(runner.optimizer(made), "mse")
    data = tf.data.Dataset.from_tensor_slices(examples())
    model.fit(runner.dataset(data, batch), epochs=epochs, verbose=0)
    return model


def plain(layers, weights, batch=BATCH, epochs=2):
    """Plain Keras on one device, no tfdist, from `weights`, on the same batches."""
    model = keras.Sequential([keras.Input((FEATURES,)), *layers])
    model.set_weights(weights)
    model.compile(keras.optimizers.Adam(0.01), "mse")
    features, labels = examples()
    model.fit(features, labels, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def start_weights(layers):
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((FEATURES,)), *layers]).get_weights()


def device_of(variable):
    return variable.value.device.split("device:")[-1]


# --- equivalence ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelined():
    """A 4-Dense Pipeline, balance [2, 2], 4 micro-batches, Adam, trained 2 epochs under
    one_device over 2 devices, with TensorFlow's placement record of its first step."""
    weights = start_weights(dense_layers())
    runner = runner_for(**{"model_parallel.micro_batches": 4})
    with runner.scope():
        model = Pipeline(dense_layers(), balance=[2, 2], input_shape=(FEATURES,))
    model.set_weights(weights)
    context.enable_run_metadata()
    try:
        train(runner, model, epochs=1)
        record = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    train(runner, model, epochs=1, compile=False)
    return model, weights, record


def placed_nodes(record, marker):
    """(stage index, op, device) of every node of the traced steps whose name holds
    `marker` + index, from the graphs TensorFlow ran (its placement, not the request)."""
    found = []
    for function in record.function_graphs:
        for graph in function.partition_graphs:
            for node in graph.node:
                if marker in node.name and node.op not in ("_Send", "_Recv"):
                    index = int(node.name.split(marker)[1][0])
                    found.append((index, node.op, node.device.split("device:")[-1]))
    return found


def test_a_pipeline_equals_one_device(pipelined):
    model, weights, _ = pipelined
    expected = plain(dense_layers(), weights)
    assert largest_difference(model.get_weights(), expected.get_weights()) < TOLERANCE
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS


def test_each_stage_runs_forward_and_backward_on_its_device(pipelined):
    _, _, record = pipelined
    nodes = placed_nodes(record, "pipeline_stage_")
    assert {(stage, device) for stage, _, device in nodes} == {(0, "CPU:0"), (1, "CPU:1")}
    for stage in (0, 1):
        ops = collections.Counter(op for index, op, _ in nodes if index == stage)
        # 2 Dense layers x 4 micro-batches: forward matmuls (fused with bias and relu) and
        # the backward ones (the kernel's gradient, and the input's where it is needed),
        # and the bias gradients.
        assert sum(count for op, count in ops.items() if "MatMul" in op) >= 2 * 2 * 4, ops
        assert ops["BiasAddGrad"] == 2 * 4, ops


def test_each_stage_keeps_its_variables_and_adam_state(pipelined):
    model, _, _ = pipelined
    for index, stage in enumerate(model.stages):
        assert {device_of(v) for layer in stage for v in layer.weights} == {f"CPU:{index}"}
    slots = collections.defaultdict(int)
    for variable in model.optimizer.variables:
        if len(variable.shape):  # Adam's moments; not the step count or the rate.
            slots[device_of(variable)] += int(np.prod(variable.shape)) * 4
    held = collections.defaultdict(int)
    for variable in model.trainable_variables:
        held[device_of(variable)] += int(np.prod(variable.shape)) * 4
    assert dict(slots) == {device: 2 * size for device, size in held.items()}
    assert len(held) == 2


def test_keras_alone_puts_every_slot_on_the_first_device():
    # What SLOTS_BESIDE_THEIR_VARIABLES fixes: undone, the same pipeline's slots all land
    # on CPU:0 (Keras builds the optimizer inside its traced step).
    patch = keras_optimizer.SLOTS_BESIDE_THEIR_VARIABLES
    runner = runner_for()
    with runner.scope():
        model = Pipeline(dense_layers(), balance=[2, 2], input_shape=(FEATURES,))
    assert patch.undo()
    try:
        train(runner, model, epochs=1)
    finally:
        patch.apply()
    assert {device_of(v) for v in model.optimizer.variables if len(v.shape)} == {"CPU:0"}


def test_a_column_row_pair_equals_one_device_with_its_kernels_split():
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(OUTPUTS)]
    weights = start_weights(layers)
    runner = runner_for()
    with runner.scope():
        model = keras.Sequential([keras.Input((FEATURES,)),
                                  ColumnParallelDense(16, activation="relu"),
                                  RowParallelDense(OUTPUTS)])
    for layer, (kernel, bias) in zip(model.layers, [weights[:2], weights[2:]]):
        layer.set_weights([kernel, bias])
    train(runner, model)
    expected = plain([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(OUTPUTS)],
                     weights)
    for parallel, dense in zip(model.layers, expected.layers):
        assert largest_difference(parallel.get_weights(), dense.get_weights()) < TOLERANCE
    column, row = model.layers
    assert [(device_of(k), tuple(k.shape)) for k in column.kernels] == [
        ("CPU:0", (FEATURES, 8)), ("CPU:1", (FEATURES, 8))]
    assert [(device_of(k), tuple(k.shape)) for k in row.kernels] == [
        ("CPU:0", (8, OUTPUTS)), ("CPU:1", (8, OUTPUTS))]
    for device in ("CPU:0", "CPU:1"):
        kernels = sum(int(np.prod(v.shape)) for v in model.trainable_variables
                      if device_of(v) == device)
        slots = sum(int(np.prod(v.shape)) for v in model.optimizer.variables
                    if len(v.shape) and device_of(v) == device)
        assert slots == 2 * kernels


def test_a_plain_models_weights_load_into_the_parallel_pair_and_back():
    with tfdist.parallel.use_devices(DEVICES):
        column = ColumnParallelDense(6)
        row = RowParallelDense(3)
    column.build((None, 4))
    row.build((None, 6))
    kernel = np.arange(24, dtype="float32").reshape(4, 6)
    column.set_weights([kernel, np.arange(6, dtype="float32")])
    np.testing.assert_array_equal(column.get_weights()[0], kernel)
    np.testing.assert_array_equal(column.kernels[1].numpy(), kernel[:, 3:])
    rows = kernel.T[:, :3]  # 6 inputs, 3 units
    row.set_weights([rows, np.ones(3, "float32")])
    np.testing.assert_array_equal(row.get_weights()[0], rows)
    np.testing.assert_array_equal(row.kernels[1].numpy(), rows[3:])


def test_a_pipeline_with_remat_equals_one_device():
    # Each stage's inside recomputed in the backward pass: the same update.
    weights = start_weights(dense_layers())
    runner = runner_for(**{"model_parallel.micro_batches": 2})
    with runner.scope():
        model = Pipeline(dense_layers(), balance=[2, 2], remat=True, input_shape=(FEATURES,))
    model.set_weights(weights)
    train(runner, model)
    expected = plain(dense_layers(), weights)
    assert largest_difference(model.get_weights(), expected.get_weights()) < TOLERANCE


def test_a_pipeline_saves_as_a_plain_sequential_loads_and_keras_loads_it_back(tmp_path):
    with tfdist.parallel.use_devices(DEVICES):
        model = Pipeline(dense_layers(), micro_batches=2, input_shape=(FEATURES,))
    model.compile("adam", "mse")
    model.save_weights(tmp_path / "pipeline.weights.h5")
    plain_model = keras.Sequential([keras.Input((FEATURES,)), *dense_layers()])
    plain_model.load_weights(tmp_path / "pipeline.weights.h5")
    assert largest_difference(plain_model.get_weights(), model.get_weights()) == 0
    model.save(tmp_path / "pipeline.keras")
    loaded = keras.models.load_model(tmp_path / "pipeline.keras")
    assert (type(loaded), loaded.balance, loaded.micro_batches) == (Pipeline, [2, 2], 2)
    assert largest_difference(loaded.get_weights(), model.get_weights()) == 0


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_its_heads_split_equals_keras_multi_head_attention(causal):
    sequence, width = 5, 8

    def model(attention):
        tokens = keras.Input((sequence, width))
        attended = attention(tokens, tokens, use_causal_mask=causal)
        return keras.Model(tokens, keras.layers.Dense(OUTPUTS)(keras.layers.Flatten()(attended)))

    keras.utils.set_random_seed(4)
    plain_model = model(keras.layers.MultiHeadAttention(num_heads=4, key_dim=3))
    runner = runner_for()
    with runner.scope():
        parallel_model = model(ParallelMultiHeadAttention(num_heads=4, key_dim=3))
    for parallel, plain_layer in zip(parallel_model.layers, plain_model.layers):
        # The attention takes MultiHeadAttention's whole weights, in its order.
        parallel.set_weights(plain_layer.get_weights())
    rng = np.random.RandomState(1)
    features = rng.randn(64, sequence, width).astype("float32")
    labels = rng.randn(64, OUTPUTS).astype("float32")
    # SGD: the key bias's gradient is zero but for rounding (softmax ignores a constant
    # added to every key's score), and Adam would turn that rounding into whole steps.
    plain_model.compile(keras.optimizers.SGD(0.1), "mse")
    plain_model.fit(features, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
    with runner.scope():
        parallel_model.compile(runner.optimizer(keras.optimizers.SGD(0.1)), "mse")
    parallel_model.fit(runner.dataset(tf.data.Dataset.from_tensor_slices((features, labels)),
                                      16), epochs=2, verbose=0)
    for parallel, plain_layer in zip(parallel_model.layers, plain_model.layers):
        if plain_layer.weights:
            assert largest_difference(parallel.get_weights(),
                                      plain_layer.get_weights()) < TOLERANCE
    attention = parallel_model.layers[1]
    assert [device_of(part["query_kernel"]) for part in attention.parts] == ["CPU:0", "CPU:1"]
    assert tuple(attention.parts[1]["query_kernel"].shape) == (width, 2, 3)  # 2 heads of 4


def test_a_tensor_parallel_models_weights_file_holds_whole_kernels_and_loads_back(tmp_path):
    import h5py

    def pair(devices):
        with tfdist.parallel.use_devices(devices):
            return keras.Sequential([keras.Input((FEATURES,)),
                                     ColumnParallelDense(16, activation="relu"),
                                     RowParallelDense(OUTPUTS)])

    saved, loaded = pair(DEVICES), pair(DEVICES[:1])  # Saved split in 2, loaded whole.
    saved.save_weights(tmp_path / "pair.weights.h5")
    with h5py.File(tmp_path / "pair.weights.h5") as stored:
        # What a Dense layer stores: its whole kernel, then its bias.
        kernel = stored["layers/column_parallel_dense/vars/0"][()]
        np.testing.assert_array_equal(kernel, saved.layers[0].get_weights()[0])
        assert stored["layers/row_parallel_dense/vars/0"].shape == (16, OUTPUTS)
    loaded.load_weights(tmp_path / "pair.weights.h5")
    for first, second in zip(saved.layers, loaded.layers):
        assert largest_difference(first.get_weights(), second.get_weights()) == 0


# --- balance --------------------------------------------------------------------------------


def test_balance_none_cuts_eight_equal_blocks_four_and_four():
    with tfdist.parallel.use_devices(DEVICES):
        model = Pipeline(dense_layers(8, units=FEATURES)[:-1] + [keras.layers.Dense(FEATURES)],
                         input_shape=(FEATURES,))
    assert model.balance == [4, 4]


def test_fewer_layers_than_devices_says_which_devices_stay_idle(caplog):
    import logging

    with caplog.at_level(logging.WARNING), tfdist.parallel.use_devices(DEVICES):
        model = Pipeline([keras.layers.Dense(FEATURES)], input_shape=(FEATURES,))
    assert model.balance == [1]
    said = [r.getMessage() for r in caplog.records if "stay idle" in r.getMessage()]
    assert said == ["tfdist: Pipeline has 1 layers for 2 devices: 1 devices stay idle (a stage "
                    "holds at least one layer); set model_parallel.devices to 1"]


@pytest.mark.parametrize("costs, stages, sizes", [
    ([1] * 8, 2, [4, 4]),
    ([4, 1, 1, 1, 1], 2, [1, 4]),
    ([1, 1, 1, 1, 4], 2, [4, 1]),
    ([3, 3, 2, 2, 2], 3, [1, 2, 2]),
    ([5], 1, [1]),
])
def test_balanced_cut_minimises_the_largest_stage(costs, stages, sizes):
    assert balanced_cut(costs, stages) == sizes


# --- composition ----------------------------------------------------------------------------


def test_accumulation_composes_with_the_pipeline():
    # Micro-batches of 8, 2 per update, the pipeline cutting each into 2: one device on
    # batches of 16.
    weights = start_weights(dense_layers())
    runner = runner_for(accumulation_steps=2, **{"model_parallel.micro_batches": 2})
    with runner.scope():
        model = Pipeline(dense_layers(), balance=[2, 2], input_shape=(FEATURES,))
    model.set_weights(weights)
    train(runner, model, batch=BATCH // 2)
    expected = plain(dense_layers(), weights)
    assert largest_difference(model.get_weights(), expected.get_weights()) < TOLERANCE


def test_mixed_bfloat16_composes_with_the_pipeline():
    # SGD: Adam's normalised step would turn bfloat16's rounding of a near-zero gradient
    # into a whole step of the learning rate.
    weights = start_weights(dense_layers())
    runner = runner_for(precision="mixed_bfloat16", **{"model_parallel.micro_batches": 2})
    with runner.scope():
        model = Pipeline(dense_layers(), balance=[2, 2], input_shape=(FEATURES,))
    model.set_weights(weights)
    train(runner, model, optimizer="sgd")
    one_device = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device",
                                                             "precision": "mixed_bfloat16"}))
    with one_device.scope():  # The same policy, one device, no pipeline.
        reference = keras.Sequential([keras.Input((FEATURES,)), *dense_layers()])
    reference.set_weights(weights)
    train(one_device, reference, optimizer="sgd")
    assert model.layers[0].compute_dtype == "bfloat16"
    # bfloat16 keeps 8 bits of mantissa: the micro-batches' sums round differently.
    difference = largest_difference(model.get_weights(), reference.get_weights())
    assert difference < 2e-3
    assert largest_difference(model.get_weights(), weights) > 50 * difference


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: Pipeline(dense_layers(), balance=[1, 1, 2]),
     r"Pipeline has 3 stages but 2 devices: give at most one stage per device"),
    (lambda: Pipeline(dense_layers(), balance=[2, 1]),
     r"Pipeline balance must give each stage at least one layer and sum to the 4 layers. "
     r"Received: balance=\[2, 1\] \(sum 3\)"),
    (lambda: ColumnParallelDense(15),
     r"ColumnParallelDense splits its units over 2 devices, which must divide them. "
     r"Received: units=15, devices=2"),
    (lambda: RowParallelDense(4).build((None, 7)),
     r"RowParallelDense splits its input width over 2 devices, which must divide them"),
    (lambda: ParallelMultiHeadAttention(num_heads=3, key_dim=4),
     r"ParallelMultiHeadAttention splits its heads over 2 devices, which must divide them. "
     r"Received: num_heads=3, devices=2"),
])
def test_bad_shapes_are_one_line(make, message):
    with tfdist.parallel.use_devices(DEVICES), pytest.raises(tfdist.ConfigError, match=message):
        make()


def test_micro_batches_that_do_not_divide_the_batch_are_one_line():
    runner = runner_for(**{"model_parallel.micro_batches": 3})
    data = tf.data.Dataset.from_tensor_slices(examples())
    with pytest.raises(tfdist.ConfigError, match=r"model_parallel.micro_batches=3 must divide "
                                                 r"each replica's batch of 16 examples"):
        runner.dataset(data, BATCH)


def test_a_batch_that_does_not_divide_is_cut_as_evenly_as_it_goes():
    # Evaluation's last batch (drop_remainder=False), or fewer examples than micro-batches:
    # the same outputs as the plain model.
    weights = start_weights(dense_layers())
    with tfdist.parallel.use_devices(DEVICES):
        model = Pipeline(dense_layers(), balance=[2, 2], micro_batches=4,
                         input_shape=(FEATURES,))
    model.set_weights(weights)
    plain_model = keras.Sequential([keras.Input((FEATURES,)), *dense_layers()])
    plain_model.set_weights(weights)
    features = examples()[0]
    for count in (39, 3):
        np.testing.assert_allclose(model.predict(features[:count], batch_size=count, verbose=0),
                                   plain_model.predict(features[:count], verbose=0),
                                   atol=1e-6)
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices(examples(steps=1, batch=39)).batch(16)
    assert model.evaluate(data, verbose=0) == pytest.approx(
        keras.losses.MeanSquaredError()(examples(steps=1, batch=39)[1],
                                        plain_model.predict(features[:39], verbose=0)),
        rel=1e-5)


def test_a_parallel_layer_with_no_devices_says_where_they_come_from():
    with pytest.raises(tfdist.ConfigError, match=r"Pipeline needs the devices to spread the "
                                                 r"model over: build it inside runner.scope\(\)"):
        Pipeline(dense_layers())


@pytest.mark.parametrize("strategy, reason", [
    ("mirrored", "tensorflow/tensorflow#33645.*use strategy horovod"),
    ("multi_worker", "tensorflow/tensorflow#33645.*use strategy horovod"),
    ("parameter_server", "its variables live on the parameter servers.*use strategy horovod"),
    ("tpu", "TPUStrategy places each replica on one TPU core.*set model_parallel.devices 1"),
])
def test_strategies_without_device_groups_refuse_with_the_reason(strategy, reason):
    config = tfdist.load_config(overrides={"strategy": strategy, "model_parallel.devices": 2})
    with pytest.raises(tfdist.ConfigError, match=rf"model_parallel.devices 2 cannot run under "
                                                 rf"strategy {strategy}: .*{reason}"):
        tfdist.Runner(config)
