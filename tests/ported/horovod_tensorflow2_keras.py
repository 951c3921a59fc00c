# Copyright 2019 Uber Technologies, Inc. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================

"""Horovod 0.28.1's test/parallel/test_tensorflow2_keras.py, run on tfdist.horovod.keras.

Run on every rank by tests/horovod/test_ported.py under `mpirun -np 2`, each rank
writing its own JUnit XML file (the file is not named test_*.py, so a plain pytest run
does not collect it: it needs Horovod initialised on every rank).

What changed from Horovod's file, and why (each change is Keras 3's, not the test's intent):

- Imports: `horovod.tensorflow.keras` and `horovod.keras` are both `tfdist.horovod.keras`;
  `Optimizer` is `keras.optimizers.Optimizer` (Keras 3 has one optimizer base class).
- `optimizer.lr` -> `optimizer.learning_rate`, `RMSprop(lr=...)` -> `learning_rate=`,
  `Dense(input_shape=...)` -> `keras.Input`, `Embedding(input_length=...)` dropped,
  `ThresholdedReLU(0.5)` -> `ReLU(threshold=0.5)` (removed or renamed in Keras 3).
- test_train_model_lr_schedule: `batch_size=2`, so that the 10 examples make the 5
  `steps_per_epoch` (Keras 3 stops an epoch whose arrays run out instead of cycling).
- `apply_gradients(..., experimental_aggregate_gradients=False)`: Keras 3 takes no
  keyword there. (`opt._compute_gradients(loss, var_list, tape=...)` is Horovod's, as
  Horovod calls it: tfdist's DistributedOptimizer has it. test_grad_aggregation_with_inf_grad
  is Horovod's own, line for line.)
- The testing optimizers implement Keras 3's `update_step(gradient, variable,
  learning_rate)` and take `learning_rate` as a keyword (DistributedOptimizer rebuilds
  them from their config, as Horovod does).
- `opt._agg_helper.counter` -> `opt._hvd_reduction.accumulator.micro_batches`; and
  `iterations` counts updates (Keras 3 and tfdist count applied updates, so learning-rate
  schedules follow updates), not micro-batches: `(idx + 1) // backward_passes_per_step`.
- `var.ref()` -> `id(var)` (Keras 3 variables have no `ref()`); `assertAllClose(var, ...)`
  reads `var.numpy()`; `tf.global_variables_initializer()` (TensorFlow 1) removed.
- `tf.Variable`s handed to the optimizers in the aggregation tests are `keras.Variable`s
  (Keras 3 optimizers track Keras variables), which the traced function reads from its
  closure instead of its arguments (tf.function turns a Keras variable argument into a
  tensor), as Keras 3's own train function does.
- `keras.losses.MSE` -> `keras.losses.mean_squared_error` (the alias is gone in Keras 3).
- test_legacy_optimizer: Keras 3's `keras.optimizers.legacy` optimizers raise when built,
  so the test checks that refusal, and DistributedOptimizer's of a non-Keras-3 optimizer.
- `parameterized.expand([[True], [False]])` -> one test method per case (no `parameterized`
  dependency; pytest does not parametrize unittest methods).
"""

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.optimizers import Optimizer

import tfdist.horovod.keras as hvd
import tfdist.horovod.keras as hvd_keras

hvd.init()


class TestingOptimizer(Optimizer):
    """Custom optimizer we use for testing gradient aggregation: adds the gradient."""

    def __init__(self, name, learning_rate=0.1, **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)

    def update_step(self, gradient, variable, learning_rate):
        variable.assign_add(gradient)


class Tf2KerasTests(tf.test.TestCase):
    """
    Tests for ops in horovod.tensorflow.keras.
    """

    def __init__(self, *args, **kwargs):
        super(Tf2KerasTests, self).__init__(*args, **kwargs)
        warnings.simplefilter('module')

        gpus = tf.config.experimental.list_physical_devices('GPU')
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        if gpus:
            tf.config.experimental.set_visible_devices(
                gpus[hvd.local_rank()], 'GPU')

    def test_train_model_lr_schedule(self):
        initial_lr = 0.1 * hvd.size()
        opt = keras.optimizers.Adam()
        opt = hvd.DistributedOptimizer(opt)

        def linear_multiplier(epoch):
            return epoch

        model = keras.models.Sequential()
        model.add(keras.Input((3,)))
        model.add(keras.layers.Dense(2))
        model.add(keras.layers.RepeatVector(3))
        model.add(keras.layers.ReLU(threshold=0.5))
        model.compile(loss=keras.losses.mean_squared_error,
                      optimizer=opt,
                      metrics=[keras.metrics.categorical_accuracy],
                      experimental_run_tf_function=False)
        x = np.random.random((10, 3))
        y = np.random.random((10, 3, 2))

        class StoreLearningRateCallback(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                # test learning rate warmup
                lr = self.model.optimizer.learning_rate.numpy()
                if epoch >= 0 and epoch < 5:
                    assert lr <= initial_lr or np.isclose(lr, initial_lr)

                # # test learning rate schedule callback
                if epoch > 5 and epoch < 10:
                    assert lr <= initial_lr * \
                        1e-1 or np.isclose(lr, initial_lr * 1e-1)
                if epoch > 10 and epoch < 15:
                    assert lr < initial_lr * \
                        1e-2 or np.isclose(lr, initial_lr * 1e-2)
                if epoch >= 15 and epoch < 20:
                    assert np.isclose(
                        lr, initial_lr * linear_multiplier(epoch))

        # No assertions needed for BroadcastGlobalVariableCallbacks
        # We just need to verify that it doesn't hang or error
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            hvd.callbacks.LearningRateWarmupCallback(
                initial_lr=initial_lr,
                warmup_epochs=5),
            hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=initial_lr,
                multiplier=1e-1,
                start_epoch=5,
                end_epoch=10),
            hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=initial_lr,
                multiplier=1e-2,
                start_epoch=10,
                end_epoch=15),
            hvd.callbacks.LearningRateScheduleCallback(
                initial_lr=initial_lr,
                multiplier=linear_multiplier,
                start_epoch=15,
                end_epoch=20),
            StoreLearningRateCallback()]
        train_history = model.fit(x,
                                  y,
                                  batch_size=2,
                                  steps_per_epoch=5,
                                  callbacks=callbacks,
                                  epochs=20,
                                  verbose=0)

        # test that the metrics average is being respected
        loss_metrics = train_history.history["loss"]
        loss_metrics_tensor = tf.convert_to_tensor(
            loss_metrics, dtype=tf.float32)
        expected_loss_metrics_tensor = hvd.broadcast(
            loss_metrics_tensor, root_rank=0)
        self.assertAllClose(expected_loss_metrics_tensor, loss_metrics_tensor)

    def test_sparse_as_dense(self):
        opt = keras.optimizers.RMSprop(learning_rate=0.0001)
        opt = hvd.DistributedOptimizer(opt, sparse_as_dense=True)

        model = keras.models.Sequential()
        model.add(keras.Input((10,), dtype="int32"))
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.mean_squared_error,
                      optimizer=opt,
                      experimental_run_tf_function=False)

        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))
        # No assertions, we just need to verify that it doesn't hang
        model.train_on_batch(x, y)

    def test_legacy_optimizer(self):
        if not hasattr(keras.optimizers, 'legacy'):
            self.skipTest("Keras legacy optimizers not available")

        # Keras 3 keeps the name, and refuses to build one; DistributedOptimizer
        # refuses anything that is not a Keras 3 optimizer in one line.
        with self.assertRaisesRegex(ImportError, "not supported in Keras 3"):
            keras.optimizers.legacy.Adam(learning_rate=0.0001)
        with self.assertRaisesRegex(ValueError, "wraps a Keras 3 optimizer"):
            hvd.DistributedOptimizer(object())

    def test_sparse_as_dense_with_grad_aggregation(self):
        backward_passes_per_step = 2
        opt = keras.optimizers.RMSprop(learning_rate=0.0001)
        opt = hvd.DistributedOptimizer(
            opt,
            sparse_as_dense=True,
            backward_passes_per_step=backward_passes_per_step
        )

        model = keras.models.Sequential()
        model.add(keras.Input((10,), dtype="int32"))
        model.add(keras.layers.Embedding(1000, 64))
        model.compile(loss=keras.losses.mean_squared_error,
                      optimizer=opt,
                      experimental_run_tf_function=False)

        x = np.random.randint(1000, size=(32, 10))
        y = np.random.random((32, 10, 64))

        training_steps = 3
        for _ in range(training_steps):
            model.train_on_batch(x, y)

        aggregation_counter = opt._hvd_reduction.accumulator.micro_batches.numpy()
        assert aggregation_counter == training_steps % backward_passes_per_step

    def test_grad_aggregation_with_inf_grad(self):
        backward_passes_per_step = 2
        step_count = tf.Variable(0, trainable=False, dtype=tf.int32)
        opt = tf.keras.optimizers.SGD()
        opt = hvd.DistributedOptimizer(
            opt,
            backward_passes_per_step=backward_passes_per_step,
            sparse_as_dense=True
        )
        x = tf.Variable(0.)
        var = [x]

        def loss():
            step_count.assign_add(1)
            return tf.cond(
                pred=tf.greater(step_count, 1),
                true_fn=lambda: x,
                false_fn=lambda: x * float('inf')
            )
        for _ in range(2 * backward_passes_per_step):
            # in the first aggregation cycle the gradient is infinite,
            # and it should be cleaned up to zero after apply_gradients
            # and doesn't affect the 2nd aggregation cycle
            grads_and_vars = opt._compute_gradients(loss=loss, var_list=var)
            opt.apply_gradients(grads_and_vars)
        assert tf.math.is_finite(grads_and_vars[0][0])

    def test_from_config(self):
        opt = keras.optimizers.Adam()
        hopt = hvd.DistributedOptimizer(opt)
        cfg = hopt.get_config()

        hopt_copy1 = hopt.from_config(cfg)
        self.assertEqual(cfg, hopt_copy1.get_config())

        hopt_copy2 = hopt.__class__.from_config(cfg)
        self.assertEqual(cfg, hopt_copy2.get_config())

    def test_elastic_state(self):
        v = 1.0 if hvd.rank() == 0 else 2.0
        model1 = keras.Sequential([
            keras.layers.Dense(2, activation='softmax')
        ])
        model1.build((2, 2))
        model1.set_weights(
            [np.array([[v, v], [v, v]], dtype=np.float32),
             np.array([v, v], dtype=np.float32)])

        model2 = keras.Sequential([
            keras.layers.Dense(2, activation='softmax')
        ])
        model2.build((2, 2))
        model2.set_weights(
            [np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32),
             np.array([0.0, 0.0], dtype=np.float32)])

        optimizer = keras.optimizers.Adam(0.001 * hvd.size())

        state = hvd.elastic.KerasState(
            model1,
            optimizer,
            batch=20 +
            hvd.rank(),
            epoch=10 +
            hvd.rank())
        state.sync()

        model1_weights = model1.get_weights()
        model2_weights = model2.get_weights()

        # After sync, all values should match the root rank
        for w in state.model.get_weights():
            self.assertAllClose(w, np.ones_like(w))
        assert state.batch == 20
        assert state.epoch == 10

        # Partially modify then restore
        model1.set_weights(model2_weights)
        state.batch = 21
        state.epoch = 11

        state.restore()

        for w1, w2 in zip(model1.get_weights(), model1_weights):
            self.assertAllClose(w1, w2)
        assert state.batch == 20
        assert state.epoch == 10

        # Partially modify then commit
        model1.set_weights(model2_weights)
        state.batch = 21
        state.epoch = 11

        state.commit()
        state.restore()

        for w1, w2 in zip(model1.get_weights(), model2_weights):
            self.assertAllClose(w1, w2)
        assert state.batch == 21
        assert state.epoch == 11

    def test_gradient_aggregation_averaged(self):
        self._gradient_aggregation(average_aggregated_gradients=True)

    def test_gradient_aggregation_summed(self):
        self._gradient_aggregation(average_aggregated_gradients=False)

    def _gradient_aggregation(self, average_aggregated_gradients):
        backward_passes_per_step = 4
        hvd_optimizer = hvd.DistributedOptimizer(
            optimizer=TestingOptimizer("test"),
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=True,
        )
        _ = hvd_optimizer.iterations

        x_0 = 0.0
        y_0, y_1 = 1.0, 2.0
        x = keras.Variable([x_0])
        y = keras.Variable([y_0, y_1])
        variables = [x, y]

        def loss():
            """
            loss = x - y * e1 where e1 = [1.0, 0.0]
            """
            # Gather the first row of y. It is equivalent to y * e1.
            # Use tf.gather to produce tf.IndexedSlices gradient to improve test coverage.
            gathered_y_1 = tf.gather(y.value, [0])
            return x.value - gathered_y_1

        def compute_expected_value(batch_id):
            """
            Given the loss function above, the gradient of x and y can be derived.
              dloss/dx = 1.0
              dloss/dy = [-1.0, 0.0]
            Therefore, for each step, the value of x increases by 1 and
            the value of y increases by [-1.0, 0.0].
            """
            num_of_steps = (batch_id + 1) // backward_passes_per_step

            gradient_of_x = num_of_steps * 1.0
            gradient_of_y_0 = num_of_steps * -1.0

            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step

            # Add gradient with its initial values because the TestingOptimizer optimize
            # variable by assign_add.
            expected_x = x_0 + gradient_of_x
            expected_y_0 = y_0 + gradient_of_y_0
            # It should remain constant as gradient is always 0.
            expected_y_1 = y_1

            return np.array(expected_x), np.array([expected_y_0, expected_y_1])

        @tf.function
        def compute_and_apply_gradients_in_tf_function():
            var_list = traced_variables
            # Compute and apply gradient updates in tf.function to reproduce
            # how it is done inside `model.fit()`.
            grads_and_vars = hvd_optimizer._compute_gradients(
                loss, var_list=var_list)
            hvd_optimizer.apply_gradients(grads_and_vars)

        traced_variables = variables
        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function()

            expected_x, expected_y = compute_expected_value(idx)
            updated_x = variables[0].numpy()
            updated_y = variables[1].numpy()
            assert np.isclose(updated_x, expected_x)
            assert np.isclose(updated_y, expected_y).all()
            assert (idx + 1) // backward_passes_per_step == hvd_optimizer.iterations.numpy()

        aggregation_counter = hvd_optimizer._hvd_reduction.accumulator.micro_batches.numpy()
        assert aggregation_counter == total_num_of_steps % backward_passes_per_step

    def test_gradient_aggregation_with_local_vars_averaged(self):
        self._gradient_aggregation_with_local_vars(average_aggregated_gradients=True)

    def test_gradient_aggregation_with_local_vars_summed(self):
        self._gradient_aggregation_with_local_vars(average_aggregated_gradients=False)

    def _gradient_aggregation_with_local_vars(self, average_aggregated_gradients):
        backward_passes_per_step = 4
        hvd_optimizer = hvd.DistributedOptimizer(
            optimizer=TestingOptimizer("test"),
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            sparse_as_dense=True,
        )

        _ = hvd_optimizer.iterations

        total_num_variables = 8
        num_local_vars = 4
        X_0 = [0.0]*total_num_variables
        Y_0, Y_1 = [1.0]*total_num_variables, [2.0]*total_num_variables
        X = [keras.Variable([x_0]) for x_0 in X_0]
        Y = [keras.Variable([y_0, y_1]) for y_0, y_1 in zip(Y_0, Y_1)]
        variables = [X, Y]
        flatten_variables = [item for sublist in variables for item in sublist]
        for i in range(num_local_vars):
            x_var = X[i]
            y_var = Y[i]
            hvd_optimizer.register_local_var(x_var)
            hvd_optimizer.register_local_var(y_var)

        def loss():
            """
            loss = x - y * er where er = [float(hvd.rank()+1), 0.0]
            """
            # Gather the first row of y. It is equivalent to y * er.
            # Use tf.gather to produce tf.IndexedSlices gradient to improve test coverage.
            gathered_y_1 = tf.gather([v.value for v in Y], [0], axis=1)
            return tf.stack([v.value for v in X]) - (float(hvd.rank()+1) * gathered_y_1)

        def compute_expected_value(batch_id):
            """
            Given the loss function above, the gradient of x and y can be derived.
              dloss/dx = 1.0
              dloss/dy = [-float(hvd.rank()+1), 0.0]
            Therefore, for each step, the value of x increases by 1.0 and
            the value of y increases by [-float(hvd.rank()), 0.0].
            """
            num_of_steps = (batch_id + 1) // backward_passes_per_step

            gradient_of_x = num_of_steps * 1.0

            # At each rank, the gradient of y_0 evaluates to (hvd.rank()+1).
            # For non-local variables we need to average the value accross the ranks.
            # The average value is (1+2+...hvd.size())/hvd.size() wich is
            # equivalent to the following expression:
            gradient_of_y_multiplier = float(hvd.size()+1)/2
            gradient_of_y_0 = num_of_steps * gradient_of_y_multiplier * -1.0

            if not average_aggregated_gradients:
                gradient_of_x *= backward_passes_per_step
                gradient_of_y_0 *= backward_passes_per_step

            expected_x = np.array(X_0)

            for i in range(len(X_0)):
                if i < num_local_vars:
                    expected_x[i] += gradient_of_x/hvd.size()
                else:
                    expected_x[i] += gradient_of_x

            expected_y_0 = np.array(Y_0)
            for i in range(len(Y_0)):
                if i < num_local_vars:
                    # recover the gradient of local vars
                    expected_y_0[i] += ((gradient_of_y_0/gradient_of_y_multiplier)*float(hvd.rank()+1))/hvd.size()
                else:
                    expected_y_0[i] += gradient_of_y_0

            # It should remain constant as gradient is always 0.
            expected_y_1 = np.array(Y_1)
            expected_y = [[ey0, ey1] for ey0,ey1 in zip(expected_y_0, expected_y_1)]

            return np.reshape(expected_x, (-1, 1)), np.array(expected_y)

        @tf.function
        def compute_and_apply_gradients_in_tf_function():
            var_list = traced_variables
            # Compute and apply gradient updates in tf.function to reproduce
            # how it is done inside `model.fit()`.
            grads_and_vars = hvd_optimizer._compute_gradients(
                loss, var_list=var_list)
            hvd_optimizer.apply_gradients(grads_and_vars)

        traced_variables = flatten_variables
        total_num_of_steps = 10
        for idx in range(total_num_of_steps):
            compute_and_apply_gradients_in_tf_function()

            expected_x, expected_y = compute_expected_value(idx)
            updated_x = np.array([v.numpy() for v in variables[0]])
            updated_y = np.array([v.numpy() for v in variables[1]])
            assert np.isclose(updated_x, expected_x).all()
            assert np.isclose(updated_y, expected_y).all()
            assert (idx + 1) // backward_passes_per_step == hvd_optimizer.iterations.numpy()

        aggregation_counter = hvd_optimizer._hvd_reduction.accumulator.micro_batches.numpy()
        assert aggregation_counter == total_num_of_steps % backward_passes_per_step

    def test_partial_distributed_optimizer(self):
        """ Note: test makes most sense with more than 1 nodes. """
        if hvd.size() == 1:
            self.skipTest("Only one worker available")

        # the keras model has 3 layers, we test cases with 0, 1, and 2 local layers.
        for num_local_layers in range(3):
            model = keras.models.Sequential()
            initializer = keras.initializers.Constant(hvd.rank())
            model.add(keras.Input((3,)))
            model.add(keras.layers.Dense(2, kernel_initializer=initializer, bias_initializer=initializer))
            model.add(keras.layers.RepeatVector(3))
            model.add(keras.layers.TimeDistributed(keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer)))
            opt = tf.keras.optimizers.Adam()
            model.compile(loss=keras.losses.mean_squared_error,
                          metrics=[keras.metrics.categorical_accuracy])

            X = np.random.random((1, 3))
            Y = np.random.random((1, 3, 3))

            with tf.GradientTape(persistent=True) as tape:
                p = model(X, training=True)
                l = tf.reduce_mean(model.loss(Y, p))

            gradients_tape = tape.gradient(l, model.trainable_weights)

            # deem local layers
            local_layers = model.layers[:num_local_layers]

            opt = hvd_keras.PartialDistributedOptimizer(opt, sparse_as_dense=True, local_layers=local_layers)
            gradients_vars_opt = opt._compute_gradients(l, model.trainable_weights, tape=tape)

            var_grad_tape = {id(var): grad for var, grad in zip(model.trainable_weights, gradients_tape)}
            var_grad_opt = {id(var): grad for grad, var in gradients_vars_opt}
            local_vars = [id(var) for layer in local_layers for var in layer.trainable_weights]

            for var in model.trainable_weights:
                if id(var) in local_vars:
                    # local gradients should not change.
                    self.assertAllClose(var_grad_tape[id(var)], hvd.size()*var_grad_opt[id(var)])
                else:
                    # non-local gradients shouldn't be equal given that the initial weights are set to ranks
                    self.assertNotAllClose(var_grad_tape[id(var)], var_grad_opt[id(var)])

    def test_broadcast_global_variables_callback_with_local_vars(self):
        """ Note: test makes most sense with more than 1 nodes. """
        if hvd.size() == 1:
            self.skipTest("Only one worker available")

        root_rank = hvd.size() - 1

        X = np.random.random((1, 3))
        Y = np.random.random((1, 3, 3))

        # all of the model's layers are set to be non-trainable
        # so that we can assert their inital variable values are
        # as expected after the call to model.fit() with the call back
        model = keras.models.Sequential()
        # the inital value for all variables is set ot each rank's value
        initializer = keras.initializers.Constant(hvd.rank())
        model.add(keras.Input((3,)))
        model.add(keras.layers.Dense(3, kernel_initializer=initializer,
                                     bias_initializer=initializer, trainable=False))
        model.add(keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer, trainable=False))
        model.add(keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer, trainable=False))
        model.add(keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer, trainable=False))
        model.add(keras.layers.RepeatVector(3))
        model.add(keras.layers.Dense(3, kernel_initializer=initializer, bias_initializer=initializer, trainable=False))
        model.compile(loss=keras.losses.mean_squared_error,
                      metrics=[keras.metrics.categorical_accuracy])

        # deem first layer's variables as local
        local_variables = [var for var in model.layers[0].variables]
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=root_rank, local_variables=local_variables)]
        model.fit(X, Y, callbacks=callbacks, verbose=0)
        local_variables_ref = [id(var) for var in local_variables]
        for var in model.variables:
            if id(var) in local_variables_ref:
                # the value for local variables should not change and remain as rank's value
                self.assertAllClose(var.numpy(), tf.constant(float(hvd.rank()), shape=var.shape))
            else:
                # the value for non-local variables should equal the root rank's value
                self.assertAllClose(var.numpy(), tf.constant(float(root_rank), shape=var.shape))
