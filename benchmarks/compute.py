"""Compute time per training step of the scaling projection's models, on one device.

ResNet-50 (224 x 224 images, 1000 classes) and a 100 M-parameter MLP (8192-wide
Dense layers) train with plain Keras `model.fit` on synthetic data: no strategy,
no synchronisation, so the time is compute alone. It runs on whatever Keras backend
and device are present: TensorFlow on this machine's CPU inside `make bench`, or
JAX on a GPU (see benchmarks/measured/README.md), which is how a GPU figure is
measured where no GPU build of TensorFlow can be installed.

    .venv/bin/python benchmarks/compute.py [--batch 8] [--steps 3] [--precision float32]

The last line is JSON: milliseconds per step (median of the steps after the
first epoch) for each model, with the backend, device, batch and precision.
"""

from __future__ import annotations

import argparse
import statistics

from method import epoch_timer
from processes import write_report

MODELS = ("resnet50", "mlp100m")
MLP_WIDTHS = (8192, 8192, 4096, 1000)  # 67.1 M + 33.6 M + 4.1 M weights: about 100 M


def build(name: str):
    import keras

    if name == "resnet50":
        return keras.applications.ResNet50(weights=None), (224, 224, 3), 1000
    layers = [keras.Input((MLP_WIDTHS[0],))]
    layers += [keras.layers.Dense(width, activation="relu") for width in MLP_WIDTHS[1:-1]]
    layers.append(keras.layers.Dense(MLP_WIDTHS[-1]))
    return keras.Sequential(layers), (MLP_WIDTHS[0],), MLP_WIDTHS[-1]


def step_ms(name: str, batch: int, steps: int, epochs: int) -> dict:
    import keras
    import numpy as np

    model, shape, classes = build(name)
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=name != "resnet50"))
    rng = np.random.default_rng(0)
    features = rng.random((batch * steps, *shape), dtype=np.float32)
    labels = rng.integers(0, classes, batch * steps).astype("int32")

    timer = epoch_timer()
    model.fit(features, labels, batch_size=batch, epochs=epochs, verbose=0, shuffle=False,
              callbacks=[timer])
    per_step = [seconds / steps * 1e3 for seconds in timer.seconds[1:]]  # first: compiling
    return {"ms": statistics.median(per_step), "low": min(per_step), "high": max(per_step),
            "parameters": model.count_params(),
            "gradient_tensors": len(model.trainable_weights)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="examples per step")
    parser.add_argument("--steps", type=int, default=3, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the first: warm-up)")
    parser.add_argument("--precision", default="float32",
                        help="a Keras dtype policy: float32, mixed_bfloat16, mixed_float16")
    parser.add_argument("--models", action="append", choices=MODELS)
    parser.add_argument("--output", help="write the JSON here rather than print it")
    args = parser.parse_args()

    import keras

    keras.mixed_precision.set_dtype_policy(args.precision)
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = str(jax.devices()[0].device_kind)
    else:
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        device = "GPU" if gpus else "CPU"
    results = {name: step_ms(name, args.batch, args.steps, args.epochs)
               for name in args.models or MODELS}
    for name, result in results.items():
        print(f"{name}: {result['ms']:.1f} ms per step of {args.batch} "
              f"({result['parameters'] / 1e6:.1f} M parameters, {backend} on {device})")
    write_report(args.output, {"benchmark": "compute", "backend": backend, "device": device,
                               "batch": args.batch, "precision": args.precision,
                               "models": results})


if __name__ == "__main__":
    main()
