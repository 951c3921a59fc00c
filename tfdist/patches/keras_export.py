"""A patch to Keras 3's `Model.export` (`keras/src/models/model.py`): the whole weights of a
model stored as ZeRO stage-3 slices.

At `zero_stage: 3` each Keras variable of the user's model holds this rank's slice of the
weight (`tfdist.sharding.weights.ShardedWeight`), and every read of it gathers the slices
across ranks, a Horovod collective. `model.export` traces the model's call, so the
SavedModel would hold Horovod's ops, which a served model has not got; and it runs on the
chief alone, where no collective can. The replacement gives each such variable, for the
export alone, a plain `tf.Variable` holding its whole value (kept on every rank at the end
of the last fit), then puts the slice back. A model with no such variable exports as
Keras exports it.

Example:

    from tfdist import patches

    patches.apply(patches.HOROVOD)   # among them, this one
    model.export("served")           # on rank 0, after fit, at zero_stage 3
"""

from __future__ import annotations

from typing import Any, Callable

from tfdist.patches.base import Patch, source_contains


def _model_class() -> Any:
    from keras.src.models import model

    return model.Model


def _whole_weights(original: Callable) -> Callable:
    def export(self, filepath, *args, **kwargs):
        # Duck-typed, so that patches import nothing above them: a stored slice answers
        # `whole_value()` (tfdist.sharding.weights.ShardedWeight).
        sliced = [variable for variable in self.variables
                  if hasattr(getattr(variable, "_value", None), "whole_value")]
        if not sliced:
            return original(self, filepath, *args, **kwargs)
        import tensorflow as tf

        slices = [variable._value for variable in sliced]
        try:
            with tf.init_scope():
                for variable, stored in zip(sliced, slices):
                    variable._value = tf.Variable(stored.whole_value(), name=variable.name,
                                                  trainable=stored.trainable)
            return original(self, filepath, *args, **kwargs)
        finally:
            for variable, stored in zip(sliced, slices):
                variable._value = stored

    return export


ZERO3_WHOLE_WEIGHTS = Patch(
    "keras.model.export_whole_sharded_weights",
    owner=_model_class, attribute="export", replacement=_whole_weights,
    bug_present=lambda original: (source_contains(original, "export_saved_model")
                                  and not source_contains(original, "whole_value")),
    upstream="none: tfdist's own storage of ZeRO stage-3 weights as slices",
    summary="at zero_stage 3, model.export traces Horovod's gathers into the SavedModel")
