"""Trains a fixed model on fixed data under a tfdist Runner; the chief saves the weights.

Run by tests under `tfdist launch` (one process per worker) to compare with one_device:

    tfdist launch -n 2 -- python tests/scripts/multi_worker_weights.py OUT.npz \
        [--cpu_replicas N] [--optimizer sgd|adam] [--accumulation_steps K] [--bytes_per_pack B] \
        [--inf_at_step S [--keras_loss_scaling]] [--undo FIX] [--bare]

--inf_at_step S trains under mixed_float16 with an inf in worker 1's half of step S
(--keras_loss_scaling: with Keras's own per-worker skip decision).
--accumulation_steps K trains with micro-batches of 1/K of the global batch, K per update,
and reports how many gradient all-reduces ran. --undo FIX removes one of tfdist's Keras
fixes after the Runner is built, to show the bug it fixes. --bare skips tfdist entirely:
plain MultiWorkerMirroredStrategy + model.fit.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.reference import examples as reference_examples  # noqa: E402
from tests.reference import initial_weights, make_model, make_optimizer  # noqa: E402

EXAMPLES, GLOBAL_BATCH, EPOCHS = 640, 64, 2  # 20 steps


def counting(optimizer):
    """The optimizer as an instance of a subclass that counts its gradient all-reduces."""
    class Counting(type(optimizer)):
        reductions = tf.Variable(0, dtype=tf.int64, trainable=False)  # outside any strategy

        def _all_reduce_sum_gradients(self, grads_and_vars):
            # Keras calls this once more for gradients tfdist has summed already
            # (tfdist.patches.keras_optimizer), and gets them back as they are.
            grads_and_vars = list(grads_and_vars)
            summed = super()._all_reduce_sum_gradients(grads_and_vars)
            if any(new is not old for (new, _), (old, _) in zip(summed, grads_and_vars)):
                Counting.reductions.assign_add(1)
            return summed

    return Counting.from_config(optimizer.get_config())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cpu_replicas", type=int, default=0)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--accumulation_steps", type=int, default=1)
    parser.add_argument("--bytes_per_pack", type=int, default=0)
    parser.add_argument("--inf_at_step", type=int, help="mixed_float16, an inf in worker 1's half")
    parser.add_argument("--keras_loss_scaling", action="store_true",
                        help="with --inf_at_step: Keras's own skip decision, per worker")
    parser.add_argument("--undo", choices=["symbolic_build", "metric_reduction"])
    parser.add_argument("--bare", action="store_true")
    args = parser.parse_args()

    if args.bare:
        tf.config.threading.set_inter_op_parallelism_threads(4)
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        dataset = tf.data.Dataset.from_tensor_slices(reference_examples(EXAMPLES))
        data, is_chief = dataset.batch(GLOBAL_BATCH, drop_remainder=True), None
    else:
        import tfdist
        from tfdist.patches import keras_trainer

        runner = tfdist.Runner(tfdist.load_config(overrides={
            "strategy": "multi_worker",
            "precision": "float32" if args.inf_at_step is None else "mixed_float16",
            "multi_worker.cpu_replicas": args.cpu_replicas,
            "multi_worker.bytes_per_pack": args.bytes_per_pack,
            "accumulation_steps": args.accumulation_steps,
            # Keras's own decision leaves one worker waiting in a collective: end the wait.
            "multi_worker.timeout_seconds": 10.0 if args.keras_loss_scaling else 0.0}))
        if args.undo == "symbolic_build":
            keras_trainer.MULTI_WORKER_SYMBOLIC_BUILD.undo()
        elif args.undo == "metric_reduction":
            keras_trainer.MULTI_WORKER_METRIC_REDUCTION.undo()
        inf_at = (None if args.inf_at_step is None
                  else args.inf_at_step * GLOBAL_BATCH + GLOBAL_BATCH - 1)
        features, labels = reference_examples(EXAMPLES, inf_at=inf_at)
        dataset = tf.data.Dataset.from_tensor_slices((features, labels))
        strategy, is_chief = runner.strategy, runner.is_chief
        data = runner.dataset(dataset, GLOBAL_BATCH // args.accumulation_steps)
    start = initial_weights()  # After the strategy: TensorFlow's runtime starts here.
    with strategy.scope():
        model = make_model()
        model.set_weights(start)
        optimizer = counting(make_optimizer(args.optimizer))
        model.compile(optimizer if args.bare else runner.optimizer(optimizer),
                      "sparse_categorical_crossentropy")
    if args.keras_loss_scaling:
        model.optimizer.finite_reduce_fn = None
    history = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0)
    print(f"replicas={strategy.num_replicas_in_sync} "
          f"iterations={int(model.optimizer.iterations.numpy())} "
          f"reductions={int(type(optimizer).reductions.numpy())} loss={history.history['loss']}")
    if is_chief:
        np.savez(args.out, *model.get_weights())


if __name__ == "__main__":
    main()
