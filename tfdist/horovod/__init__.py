"""Horovod under Keras 3: what the `horovod` adapter and the drop-in share, and the drop-in.

- `tfdist.horovod.collectives`: the gradient allreduce, the broadcast of a model's
  state from one rank and the averaging of logged metrics; one implementation
  that both front doors use.
- `tfdist.horovod.elastic`: Horovod elastic for Keras 3 (`runner.run_elastic`, and
  `tfdist.horovod.keras.elastic`): the state it commits, and the loop that restores it.
- `tfdist.horovod.keras`: the names of `horovod.tensorflow.keras` (and
  `horovod.keras`), working on Keras 3, so an existing Horovod script changes
  one import line.

Nothing here imports Horovod until it is used.
"""
