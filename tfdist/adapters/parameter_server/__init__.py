"""`parameter_server`: the adapter and the training loop Keras 3 lacks under it.

    adapter.py          ParameterServerAdapter: the strategy on the chief, servers elsewhere
    coordinated_fit.py  `model.fit`/`evaluate`/`predict` for models under the strategy,
                        reached through tfdist.patches.keras_trainer's routing
"""

from tfdist.adapters.parameter_server.adapter import ParameterServerAdapter

__all__ = ["ParameterServerAdapter"]
