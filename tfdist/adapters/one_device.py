"""`one_device`: one GPU or the CPU, through `tf.distribute.OneDeviceStrategy`.

It is the reference every other adapter is checked against: the same data and
the same global batch must give the same weights.

Example:

    runner = tfdist.Runner(tfdist.load_config(overrides={"strategy": "one_device"}))
"""

from __future__ import annotations

import tensorflow as tf

from tfdist.adapters.base import Adapter, check_device


class OneDeviceAdapter(Adapter):
    """Trains on `one_device.device`, or on the first GPU, or on the CPU."""

    zero_refusal = None  # One replica: nothing to shard, so zero_stage changes nothing.

    single_process = True

    model_parallel_refusal = None

    def create_strategy(self) -> tf.distribute.Strategy:
        if self.config.model_parallel.devices > 1:
            # OneDeviceStrategy puts every variable on its one device, whatever `tf.device`
            # the layer asks for; the default strategy leaves placement to the layers.
            return tf.distribute.get_strategy()
        device = self.config.one_device.device or ("/gpu:0" if self.cluster.gpus else "/cpu:0")
        return tf.distribute.OneDeviceStrategy(
            check_device(device, self.cluster, "one_device.device"))
