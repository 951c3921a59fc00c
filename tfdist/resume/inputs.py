"""What a resume needs from the rest of the run, handed over as the run is set up.

An exact resume replays the data order and restores what Horovod elastic committed, so
it needs things the Runner makes elsewhere: `runner.dataset` hands over each shuffle it
makes and each pipeline it returns, `runner.run_elastic` the elastic state it commits
to, and `runner.callbacks` asks for the `BackupAndRestore` made from them all.

Example:

    inputs = ResumeInputs()
    shuffle = inputs.epoch_shuffle(10_000, seed=0)       # runner.dataset
    data = inputs.track(adapter.distribute_dataset(source, 64, shuffle=shuffle))
    backup = inputs.backup("ckpt", adapter, save_every_steps=0, keep=3, grace_seconds=25,
                           settings={}, resume_changed=False)   # runner.callbacks
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:
    from tfdist.adapters.base import Adapter
    from tfdist.resume.backup import BackupAndRestore
    from tfdist.resume.shuffling import EpochShuffle


class ResumeInputs:
    """The shuffles, pipelines and elastic state of one Runner, for its `BackupAndRestore`.

    TensorFlow is imported when something is handed over, not before: the Runner makes
    this object before it checks that TensorFlow is there.
    """

    def __init__(self) -> None:
        self._shuffles: list[EpochShuffle] = []
        self._pipelines: Any = None  # tfdist.resume.shuffling.PipelineReplay, made with a dataset.
        self._elastic_state: Any = None  # Set while run_elastic's train() runs.

    def epoch_shuffle(self, buffer_size: int, seed: int) -> EpochShuffle:
        """A shuffle whose order is fixed by (`seed`, epoch), restored at a resume.

        Args:
            buffer_size: Examples in the shuffle buffer.
            seed: The run's seed.
        """
        from tfdist.resume.shuffling import EpochShuffle

        shuffle = EpochShuffle(buffer_size, seed=seed)
        self._shuffles.append(shuffle)
        return shuffle

    def track(self, dataset: Any) -> Any:
        """`dataset`, its seeded shuffles (the user's own) replayed to a resumed epoch."""
        from tfdist.resume.shuffling import PipelineReplay

        if self._pipelines is None:
            self._pipelines = PipelineReplay()
        return self._pipelines.track(dataset)

    @contextlib.contextmanager
    def committing_to(self, elastic_state: Any) -> Iterator[None]:
        """Within the block, the callbacks made also commit to Horovod elastic's state."""
        self._elastic_state = elastic_state
        try:
            yield
        finally:
            self._elastic_state = None

    def backup(self, directory: str | None, adapter: Adapter, *, save_every_steps: int,
               keep: int, grace_seconds: float, settings: Mapping[str, Any],
               resume_changed: bool) -> BackupAndRestore | None:
        """The `BackupAndRestore` for `directory` and what was handed over; None when there
        is no folder and no elastic state to commit to (nothing to save).

        Args:
            directory: The checkpoint folder, or None.
            adapter: The strategy's adapter.
            save_every_steps: Also save every this many steps (0: at epoch ends only).
            keep: Checkpoints kept.
            grace_seconds: How long a SIGTERM leaves to save.
            settings: What the run's identity records besides the model and optimizer.
            resume_changed: Resume even a run that differs from the folder's.
        """
        if not directory and self._elastic_state is None:
            return None
        from tfdist.resume.backup import BackupAndRestore

        return BackupAndRestore(
            directory or None, adapter, shuffles=self._shuffles, pipelines=self._pipelines,
            save_every_steps=save_every_steps, keep=keep, grace_seconds=grace_seconds,
            elastic_state=self._elastic_state, settings=settings,
            resume_changed=resume_changed)
