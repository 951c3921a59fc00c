"""Horovod under Keras 3: what the `horovod` adapter and the drop-in share, and the drop-in.

- `tfdist.horovod.collectives`: the gradient allreduce, the broadcast of a model's
  state from one rank and the averaging of logged metrics; one implementation
  that both front doors use.
- `tfdist.horovod.keras`: the names of `horovod.tensorflow.keras` (and
  `horovod.keras`), working on Keras 3, so an existing Horovod script changes
  one import line.

Nothing here imports Horovod until it is used.
"""
