"""The private members of Keras and TensorFlow that ZeRO relies on, each checked in the code.

The stages store and update weights below Keras's public API: a Keras variable's
`tf.Variable` is swapped for a weight that reads through collectives, that weight must
pass for a `tf.Variable` where TensorFlow saves and exports one, and the sharded
optimizer keeps Keras's weight-decay exclusions and EMA working on slices. Each member
used to do so is declared here with its owner, what tfdist does with it, and how its
presence is read from the installed code (an attribute of the class, an assignment in
its module, or a read in the source of the function that reads it), as `tfdist.patches`
reads its bugs from the code, never from a version number.

`missing()` lists the members the installed Keras and TensorFlow lack; `check(stage)`
refuses to make a ZeRO optimizer where one is missing, in one line naming it, rather
than let a step fail deep inside Keras.

Example:

    from tfdist.sharding import private

    private.missing()      # [] with the tested Keras and TensorFlow
    private.check(2)       # raises ConfigError naming what a newer Keras removed
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

from tfdist.errors import ConfigError


@functools.lru_cache(maxsize=None)
def _source(owner: Any) -> str:
    """The source of `owner`'s module for a class (a class's own source is found by
    parsing its module, a quarter of a second for these four), else of `owner`."""
    try:
        return inspect.getsource(inspect.getmodule(owner) if inspect.isclass(owner) else owner)
    except (OSError, TypeError):  # A class made at run time, or one defined in C.
        return ""


@dataclasses.dataclass(frozen=True)
class PrivateMember:
    """One private member of Keras or TensorFlow that ZeRO relies on.

    Args:
        where: The owner's dotted name, for messages.
        owner: Returns the class (or, for `read`, the function) that holds the member;
            called when checked, never when declared.
        name: The member's name.
        use: What tfdist does with it, in a few words.
        how: "attribute": the owner (or a base) has it; "assigned": the module of the
            owner or of a base assigns `self.<name> =` (an instance attribute); "read":
            the owner's source reads it from the objects it is given.

    Example:

        PrivateMember("keras Variable", _keras_variable, "_value",
                      "swapped for a weight read through collectives", how="assigned")
    """

    where: str
    owner: Callable[[], Any]
    name: str
    use: str
    how: str = "attribute"

    def present(self) -> bool:
        """Whether the installed code has the member, read from the code itself."""
        owner = self.owner()
        if self.how == "attribute":
            return hasattr(owner, self.name)
        if self.how == "assigned":
            return any(f"self.{self.name} =" in _source(cls) for cls in inspect.getmro(owner))
        if self.how == "read":
            return self.name in _source(owner)
        raise ValueError(f"how must be 'attribute', 'assigned' or 'read'. Received: "
                         f"{self.how!r}")


def _keras_variable() -> type:
    from keras.src.backend.tensorflow.core import Variable

    return Variable


def _tf_variable() -> type:
    from tensorflow.python.ops.resource_variable_ops import ResourceVariable

    return ResourceVariable


def _is_resource_variable() -> Callable[..., Any]:
    from tensorflow.python.ops.resource_variable_ops import is_resource_variable

    return is_resource_variable


def _keras_optimizer() -> type:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def _keras_tf_optimizer() -> type:
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def _keras_name_scope() -> type:
    from keras.src.backend.common.name_scope import name_scope

    return name_scope


def _keras_add_weight() -> Callable[..., Any]:
    from keras.src.layers.layer import Layer

    return Layer.add_weight


def _keras_autocast_scope() -> type:
    from keras.src.backend.common.variables import AutocastScope

    return AutocastScope


def _keras_call_context() -> type:
    from keras.src.layers.layer import Layer

    return Layer


MEMBERS: tuple[PrivateMember, ...] = (
    PrivateMember("keras Variable", _keras_variable, "_value",
                  "the tf.Variable a Keras variable holds, swapped for a weight read "
                  "through collectives (stages 2 and 3; in tfdist.sharding.hooks alone)",
                  how="assigned"),
    PrivateMember("tf is_resource_variable", _is_resource_variable,
                  "_should_act_as_resource_variable",
                  "makes that weight pass for a resource variable", how="read"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_shared_name",
                  "the weight's name where TensorFlow keys a variable by it"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_unique_id",
                  "the weight's identity in TensorFlow's tracking", how="assigned"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_serialize_to_tensors",
                  "the weight's values in a checkpoint"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_restore_from_tensors",
                  "a checkpoint's values into the weight (a slice at stage 3)"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_export_to_saved_model_graph",
                  "the whole weight in model.export's SavedModel"),
    PrivateMember("tf ResourceVariable", _tf_variable, "_write_object_proto",
                  "the weight's entry in a SavedModel"),
    PrivateMember("keras optimizer", _keras_optimizer, "_var_key",
                  "excludes a slice from weight decay as its variable is"),
    PrivateMember("keras optimizer", _keras_optimizer, "_use_weight_decay",
                  "whether the user excluded a variable from weight decay"),
    PrivateMember("keras optimizer", _keras_optimizer, "_exclude_from_weight_decay",
                  "the exclusions, extended to the slices", how="assigned"),
    PrivateMember("keras optimizer", _keras_optimizer, "_exclude_from_weight_decay_cache",
                  "cleared when the exclusions are extended", how="assigned"),
    PrivateMember("keras optimizer", _keras_optimizer,
                  "_overwrite_model_variables_with_average_value",
                  "EMA weights written into the rank's slices at a fit's end"),
    PrivateMember("keras TF optimizer", _keras_tf_optimizer, "_trackable_children",
                  "leaves each rank's partition out of the chief's checkpoint"),
    PrivateMember("keras name_scope", _keras_name_scope, "name_scope_stack",
                  "the scopes open now, whose innermost caller is the layer creating a "
                  "weight: its unit at stage 3 (tfdist.sharding.hooks)", how="read"),
    PrivateMember("keras name_scope", _keras_name_scope, "caller",
                  "the layer a scope was opened for", how="assigned"),
    PrivateMember("keras Layer.add_weight", _keras_add_weight, "caller=self",
                  "creates each weight inside its layer's scope", how="read"),
    PrivateMember("keras Layer", _keras_call_context, "_flatten_layers",
                  "a model's layers, nested ones too, to find the layer that created a "
                  "weight Keras initialised outside that layer's scope"),
    PrivateMember("keras Layer", _keras_call_context, "_trainable_variables",
                  "the weights a layer created itself: the unit of such a weight",
                  how="assigned"),
    PrivateMember("keras autocast scope", _keras_autocast_scope, "autocast_scope",
                  "the dtype a layer's call reads its weights in, re-entered around "
                  "its recompute at stage 3", how="read"),
    PrivateMember("keras Variable", _keras_variable, "_autocast",
                  "whether a layer's call reads the weight in its compute dtype: a "
                  "unit's gathers then move that dtype (tfdist.sharding.hooks)",
                  how="assigned"),
    PrivateMember("keras Layer", _keras_call_context, "current_call_ctx",
                  "the call's context (its training flag), re-entered around the "
                  "recompute", how="read"),
)


def missing(members: Sequence[PrivateMember] = MEMBERS) -> list[PrivateMember]:
    """The members the installed Keras and TensorFlow lack."""
    return [member for member in members if not member.present()]


def check(stage: int, members: Sequence[PrivateMember] = MEMBERS) -> None:
    """Raises ConfigError when a member ZeRO relies on is missing from the installed code.

    Args:
        stage: The ZeRO stage being set up, for the message.
        members: What to check (default every member declared here).
    """
    absent = missing(members)
    if absent:
        import keras
        import tensorflow as tf

        named = ", ".join(f"{member.where}.{member.name} ({member.use})" for member in absent)
        raise ConfigError(f"zero_stage {stage} relies on private members of Keras and "
                          f"TensorFlow that this Keras {keras.version()} and TensorFlow "
                          f"{tf.__version__} lack: install the versions in tfdist's "
                          f"requirements, or set zero_stage 0. Received: missing {named}")
