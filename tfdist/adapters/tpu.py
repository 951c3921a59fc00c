"""`tpu`: Cloud TPUs through `TPUClusterResolver` and `tf.distribute.TPUStrategy`.

The TPU is found from the config (`tpu.name`, `tpu.zone`, `tpu.project`) or from
the environment (`TPU_NAME`, Colab's `COLAB_TPU_ADDR`, a TPU VM's devices). With
no TPU in sight, the adapter fails with one line before contacting anything.
Precision defaults to mixed_bfloat16, the TPU's native compute type.

Example:

    config = tfdist.load_config("tpu", overrides={"tpu.name": "my-tpu"})
    runner = tfdist.Runner(config)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfdist.adapters.base import Adapter, DatasetSource
from tfdist.cluster import ClusterInfo
from tfdist.config import TPUConfig
from tfdist.errors import ConfigError, first_line
from tfdist.resume.shuffling import EpochShuffle


def resolver_arguments(options: TPUConfig, cluster: ClusterInfo) -> dict[str, str | None]:
    """The keyword arguments of `TPUClusterResolver` for this config and machine.

    Args:
        options: The config's `tpu` section; its values win over the environment.
        cluster: Detection results; `cluster.tpu` supplies a name when the config has none.

    Raises:
        ConfigError: neither the config nor the environment names a TPU.
    """
    name = options.name or (cluster.tpu.name if cluster.tpu else "")
    if not name:
        raise ConfigError("strategy tpu found no TPU (no tpu.name, no TPU_NAME, no TPU VM "
                          "devices); run on a Cloud TPU VM, or set tpu.name to your TPU's name "
                          "or grpc:// address. Received: tpu.name=''")
    return {"tpu": name, "zone": options.zone or None, "project": options.project or None}


class TPUAdapter(Adapter):
    """Connects to the TPU, initialises its system, and builds a `TPUStrategy`."""

    zero_refusal = ("tfdist shards training state with Horovod's collectives, which do not "
                    "run on TPU; set zero_stage 0")
    model_parallel_refusal = (
        "TPUStrategy places each replica on one TPU core and its variables itself, and "
        "tfdist.parallel places stages and splits with tf.device, which it overrides; set "
        "model_parallel.devices 1")

    def create_strategy(self) -> tf.distribute.Strategy:
        arguments = resolver_arguments(self.config.tpu, self.cluster)
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(**arguments)
            if arguments["tpu"] != "local":
                tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, RuntimeError, tf.errors.OpError) as error:
            reason = first_line(error) or type(error).__name__
            raise ConfigError(f"could not start the TPU '{arguments['tpu']}' ({reason}); "
                              f"check tpu.name, tpu.zone and tpu.project, or use tpu.name=local "
                              f"on a TPU VM. Received: tpu.name={arguments['tpu']!r}") from None
        return tf.distribute.TPUStrategy(resolver)

    def distribute_dataset(self, source: DatasetSource, global_batch_size: int, *,
                           drop_remainder: bool = True,
                           shuffle: EpochShuffle | None = None) -> Any:
        """As the base, but always drops the remainder: XLA compiles static shapes."""
        return super().distribute_dataset(source, global_batch_size, drop_remainder=True,
                                          shuffle=shuffle)
