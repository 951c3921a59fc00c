"""Model parallelism: one model spread over several devices of a process.

- `Pipeline`: layers cut into stages, one per device, trained on micro-batches whose
  stages overlap (GPipe).
- `ColumnParallelDense`, `RowParallelDense`: one Dense layer's matmul split over the
  devices (Megatron-LM's pair: one sum of partial products per pair);
  `ParallelMultiHeadAttention`: the heads split over the devices (one sum).
- `placement`: running a function on a device with its gradient there too; the
  devices the Runner gives (`model_parallel.devices`).

Under horovod each rank holds one copy over its own devices and the ranks are data
parallel.

Example:

    runner = tfdist.Runner(tfdist.load_config(overrides={
        "strategy": "one_device", "model_parallel.devices": 2,
        "model_parallel.micro_batches": 4}))
    with runner.scope():
        model = tfdist.parallel.Pipeline(layers, input_shape=(32,))
"""

from tfdist.parallel.pipeline import Pipeline, balanced_cut
from tfdist.parallel.placement import current_devices, on_device, use_devices
from tfdist.parallel.tensor import (ColumnParallelDense, ParallelMultiHeadAttention,
                                    RowParallelDense)

__all__ = ["ColumnParallelDense", "ParallelMultiHeadAttention", "Pipeline", "RowParallelDense",
           "balanced_cut", "current_devices", "on_device", "use_devices"]
