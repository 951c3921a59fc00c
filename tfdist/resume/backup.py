"""`BackupAndRestore`: `model.fit` that resumes exactly where a crash or preemption left it.

Keras 3's own `keras.callbacks.BackupAndRestore` restores the weights and the
epoch, but not the step: a run killed in the middle of an epoch replays that
epoch from its first batch on weights that have already seen those batches. Its
files are rewritten in place, and every worker of a multi-worker run writes and
deletes the same folder. This callback restores the exact state instead:

- **What is saved** (one `tf.train.Checkpoint`, see `tfdist.resume.checkpointing`): the
  model's variables (weights, BatchNormalization statistics, the random-generator
  states of Dropout and other random layers), the optimizer's (slots,
  `iterations`, the loss scale, gradient accumulators and their count), the
  metrics' totals, and the position: epoch, step in the epoch, steps in all.
- **Where training resumes**: at `on_train_begin` the newest good checkpoint is
  restored. `fit` starts at its epoch; the steps of that epoch already done are
  skipped, so the data (shuffled by `tfdist.resume.shuffling.EpochShuffle` in the order
  of (seed, epoch), or by the pipeline's own seeded shuffle, replayed to the
  epoch's order by `tfdist.resume.shuffling.PipelineReplay`) goes on from the next batch;
  the metrics go on from their saved totals. A finished run restarted trains no
  step.
- **When it saves**: every `save_every_steps` steps and at the end of every
  epoch; on every process, since saving replicated variables is a collective,
  but only the chief's files remain.
- **Preemption**: after SIGTERM to any process, every process stops at one
  agreed step boundary, saves, and exits with status 143 (`tfdist.resume.preemption`).
- **Horovod elastic**: with an elastic state (`runner.run_elastic`), the same
  points commit the state in memory, and a `fit` called again after a reset
  resumes from the last commit (`tfdist.horovod.elastic`).

Example:

    model.fit(runner.dataset(train, 256, shuffle_buffer_size=50_000), epochs=10,
              callbacks=runner.callbacks(checkpoint_dir="/shared/run-1/ckpt",
                                         save_every_steps=500))
"""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import keras
from absl import logging

from tfdist import sharding
from tfdist.errors import ClusterError, ConfigError
from tfdist.resume.checkpointing import (FORMAT_VERSION, CheckpointStore, TrainingPosition,
                                         checkpoint_number, read_partially)
from tfdist.resume import sharded_state
from tfdist.resume.preemption import RESTART_EXIT_CODE, PreemptionWatch, StopAgreement
from tfdist.resume.run_identity import (
    RUN_FILE, UnreadableIdentity, differences, identity, read_identity, record_identity)
from tfdist.resume.shuffling import EpochShuffle, PipelineReplay

if TYPE_CHECKING:
    from tfdist.adapters.base import Adapter

# Each fit of a process gets its own keys in the coordination service; every process
# counts its fits the same way.
_fit_serial = itertools.count()


class BackupAndRestore(keras.callbacks.Callback):
    """Saves training state periodically and on SIGTERM; restores it exactly at the next start.

    Build it with `runner.callbacks(checkpoint_dir=...)`, which gives it the
    adapter (for the chief, the collectives and the stop agreement) and the
    Runner's shuffles. It comes first among the callbacks: it restores at
    `on_train_begin`, before Horovod's broadcast of rank 0's state.

    Args:
        directory: The run's checkpoint folder, readable by every process. None:
            no files (only with `elastic_state`).
        adapter: The Runner's adapter.
        shuffles: The `EpochShuffle`s of the Runner's datasets; each epoch's order
            is set from the epoch number.
        pipelines: The datasets the Runner made, whose own shuffles are replayed to
            the resumed epoch's order. None: no dataset was made with
            `runner.dataset`, and a resume says its order may differ.
        save_every_steps: Also save every this many steps (0: at epoch ends only).
        keep: Checkpoints kept (>= 2).
        grace_seconds: How long after SIGTERM a process may take to stop.
        elastic_state: A `tfdist.horovod.elastic` state to commit to at every save point,
            and to resume from when it holds a commit.

    Example:

        callbacks = runner.callbacks(checkpoint_dir="ckpt", save_every_steps=100)
        model.fit(dataset, epochs=5, callbacks=callbacks)
    """

    def __init__(self, directory: str | None, adapter: "Adapter", *,
                 shuffles: Sequence[EpochShuffle] = (), pipelines: PipelineReplay | None = None,
                 save_every_steps: int = 0,
                 keep: int = 3, grace_seconds: float = 25.0, elastic_state: Any = None,
                 settings: Mapping[str, Any] | None = None, resume_changed: bool = False):
        super().__init__()
        if not directory and elastic_state is None:
            raise ConfigError("checkpoint_dir must name a folder. "
                              f"Received: checkpoint_dir={directory!r}")
        for name, value, lowest in (("save_every_steps", save_every_steps, 0), ("keep", keep, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
                raise ConfigError(f"{name} must be an integer >= {lowest}. "
                                  f"Received: {name}={value!r}")
        self.directory = str(directory) if directory else None
        self._settings = dict(settings or {})
        self._resume_changed = resume_changed
        self.save_every_steps = save_every_steps
        self.keep = keep
        self._adapter = adapter
        self._shuffles = shuffles
        self._pipelines = pipelines if pipelines is not None else PipelineReplay()
        self._elastic = elastic_state
        self._watch = PreemptionWatch(grace_seconds)
        self._position = (elastic_state.position if elastic_state is not None
                          and elastic_state.position is not None else TrainingPosition())
        self._store: CheckpointStore | None = None
        self._agreement: StopAgreement | None = None
        self._put_back_metrics: Callable[[], None] | None = None
        self._resume_epoch: int | None = None  # The epoch a restore landed in.
        self._skip = 0  # Steps of the resumed epoch done before the restore.
        self._saved_global_step = -1
        self._saved_at: tuple[int, int, int] | None = None
        self._boundary = 0
        self._sharded: Any = None  # The optimizer, when it shards its state (tfdist.sharding).
        self._train_function: Any = None  # Keras's, while the skipping one stands in.
        self._saved_variables: list[Any] = []
        self._summed_variables: list[Any] = []  # Rank-local sums a checkpoint adds up.
        self._identity_notes: list[str] = []  # What reading run.json found wrong.

    # --- Keras hooks ----------------------------------------------------------------------

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        objects = _saved_objects(model, self._position)
        self._sharded = sharding.find_sharded(model.optimizer)
        if self.directory:
            self._store = CheckpointStore(self.directory, objects,
                                          is_writer=self._adapter.is_chief, keep=self.keep)
        if self._elastic is not None and self._elastic.has_commit:
            self._resume_from_commit()
        elif self._store is not None:
            self._check_same_run()
            self._resume_from_checkpoint()
        self._saved_variables = [variable for group in objects.values()
                                 for variable in _variables_of(group)]
        # Each rank's partition (adopted gradient accumulators among it) is its own, in its
        # shard file: not summed across the ranks for the chief's checkpoint.
        partition = self._partition_ids()
        self._summed_variables = [variable for variable in self._saved_variables
                                  if id(variable) not in partition]
        if self._elastic is not None:
            self._elastic.attach(model, self._saved_variables, self._position)
        self._agreement = self._adapter.stop_agreement(f"fit{next(_fit_serial)}")
        if self._agreement.needs_retrace:
            model.make_train_function(force=True)
        self._agreement.start()
        self._boundary = 0
        self._watch.install()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        # Keras has read the restored epoch by now; leave no stale value behind for a
        # later fit of the same model.
        self.model._initial_epoch = None
        resuming, self._resume_epoch = self._resume_epoch == epoch, None
        self._skip = self._skip if resuming else 0
        if self._skip:
            # Keras reset the metrics just before this call: put the saved totals back.
            self._put_back_metrics()
            if self.model.train_function is not None:
                # Keras's loop; tfdist's parameter-server loop reads `steps_to_skip`.
                self._skip_first_steps(self._skip)
        for shuffle in self._shuffles:
            shuffle.set_epoch(epoch)
        self._position.move_to(epoch, self._skip, self._position.global_step)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        done = batch + 1  # Keras passes the index of the execution's last step.
        if done > self._skip:  # Not one of the steps a resume skips.
            position = self._position
            position.move_to(position.epoch, done,
                             position.global_step + done - position.step)
            if self._save_due(done):
                self._save()
        self._boundary += 1
        if self._agreement.should_stop(self._boundary, self._watch.signalled):
            self._stop()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._position.move_to(epoch + 1, 0, self._position.global_step)
        self._save()
        # A signal that came during the epoch's last step or its validation has no step
        # boundary left in the epoch: every process reaches this point together, so one
        # small collective agrees on it here.
        if self._adapter.process_sum([float(self._watch.signalled)])[0] > 0:
            self._stop()

    def on_train_end(self, logs: Any = None) -> None:
        self._release()

    # --- what coordinated (parameter-server) training asks ------------------------------

    def wants_state_at_step(self, done: int) -> bool:
        """Whether the state after `done` steps of this epoch is to be saved, or a stop is near.

        The parameter-server loop schedules steps ahead; it waits for them to finish
        only where this says so.
        """
        return self._watch.signalled or self._save_due(done)

    @property
    def steps_to_skip(self) -> int:
        """Steps of the resumed epoch done before the restore (0 in any other epoch)."""
        return self._skip

    # --- restoring ------------------------------------------------------------------------

    def _resume_from_checkpoint(self) -> None:
        store, adapter = self._store, self._adapter
        self._check_weights_whole_or_sliced()
        # Each rank's sharded optimizer state is part of its checkpoint: shard files that do
        # not read pass the checkpoint over, as a torn index or data file does.
        path = store.restore_newest(
            also_restore=lambda found: self._restore_shards(checkpoint_number(found)))
        adapter.barrier("tfdist_restored")
        # Every process must resume from the same checkpoint, or their weights differ.
        number = checkpoint_number(path)
        total, squares = adapter.process_sum([number, number * number])
        processes = adapter.num_processes
        if total != processes * number or squares != processes * number * number:
            raise ClusterError(f"the processes of this run found different newest checkpoints "
                               f"in {self.directory} (this one: {path or 'none'}): the folder "
                               f"must be the same shared storage for every process (a shared "
                               f"file system, or gs://...)")
        if path is None:
            if self._speaks:
                logging.info("tfdist: no checkpoint in %s; training from the start",
                             self.directory)
            return
        self._position.reload()
        if self._position.format_version > FORMAT_VERSION:
            raise ConfigError(f"checkpoint {path} was written by a newer tfdist (format "
                              f"{self._position.format_version}, this one reads up to "
                              f"{FORMAT_VERSION}); upgrade tfdist to resume it. "
                              f"Received: checkpoint_dir={self.directory!r}")
        metrics = _metric_variables(self.model)

        def put_back() -> None:
            read_partially(path, {"metrics": metrics})
            self._adapter.after_restore(metrics)

        self._put_back_metrics = put_back
        notes = self._identity_notes + self._store.notes
        self._resume(f"resuming from {path}" + (f" ({'; '.join(notes)})" if notes else ""))

    def _check_weights_whole_or_sliced(self) -> None:
        """Refuses, before reading it, a checkpoint whose weights are slices (zero_stage 3)
        at stage 0 or 1: its weights would not fit the whole variables (stage 2 takes
        them whole from the shard files, `ReduceScatteredWeight`); at stage 0, one
        whose optimizer state is sharded; and one whose gradient accumulators this run
        holds otherwise (`_check_accumulators`): each before the restore reports only that
        its objects do not match."""
        stage = getattr(self._sharded, "zero_stage", 0)
        saved = sharded_state.numbers(self.directory)
        if not saved:
            return
        try:
            with sharded_state.ShardReader(self.directory, max(saved)) as reader:
                slots = reader.slots()
        except ConfigError:
            return  # Unreadable shard files: the restore passes the checkpoint over.
        sliced = sharding.WEIGHT in slots
        if self._sharded is not None:
            self._check_accumulators(max(saved), sliced, sharding.ACCUMULATED in slots)
        if stage >= 2:
            return
        if sliced:
            raise ConfigError(f"checkpoint {max(saved)} in {self.directory} holds each weight "
                              f"as slices (saved with zero_stage 3); resume it with "
                              f"zero_stage 2 or 3. Received: checkpoint_dir={self.directory!r}, "
                              f"zero_stage={stage}")
        if self._sharded is None:  # At stage 1 the shard files are this run's own kind.
            newest = self._store.candidates()[:1]
            if newest and checkpoint_number(newest[0]) == max(saved):
                self._refuse_sharded_state(max(saved))

    def _refuse_sharded_state(self, number: int) -> None:
        raise ConfigError(f"checkpoint {number} in {self.directory} holds sharded optimizer "
                          f"state (saved with zero_stage 1 or 2), which zero_stage 0 would "
                          f"leave unrestored; resume it with zero_stage 1 or 2. Received: "
                          f"checkpoint_dir={self.directory!r}")

    def _restore_shards(self, number: int) -> None:
        """Each rank's partition of the optimizer state, from every rank's shard files."""
        if self._sharded is None:
            if number in sharded_state.numbers(self.directory):
                self._refuse_sharded_state(number)  # An older checkpoint, fallen back to.
            return
        with sharded_state.ShardReader(self.directory, number) as reader:
            slots = reader.slots()
            self._sharded.load_shard_state(reader.read, weights=sharding.WEIGHT in slots,
                                           accumulated=sharding.ACCUMULATED in slots)

    def _check_accumulators(self, number: int, sliced_weights: bool,
                            sliced_accumulators: bool) -> None:
        """Refuses a checkpoint whose gradient accumulators this run would leave unrestored:
        slices (saved at zero_stage 3) where this run's are whole, or whole (in the chief's
        checkpoint, saved at zero_stage 1 or 2) where this run's are slices."""
        holds = self._sharded.holds_accumulators
        if sliced_accumulators and not holds:
            raise ConfigError(f"checkpoint {number} in {self.directory} holds gradient "
                              f"accumulators as slices (saved at zero_stage 3 with "
                              f"accumulation_steps > 1), which this run would leave "
                              f"unrestored; resume it at zero_stage 3. Received: "
                              f"checkpoint_dir={self.directory!r}, "
                              f"zero_stage={self._sharded.zero_stage}")
        if holds and not sliced_weights:
            raise ConfigError(f"checkpoint {number} in {self.directory} was saved at "
                              f"zero_stage 1 or 2, whose gradient accumulators are whole, "
                              f"where zero_stage 3 with accumulation_steps > 1 holds them as "
                              f"slices; resume it at the stage it was saved with. Received: "
                              f"checkpoint_dir={self.directory!r}, zero_stage=3")

    def _partition_ids(self) -> set[int]:
        """The ids of the variables of this rank's partition of the optimizer state."""
        return {id(variable) for variable in getattr(self._sharded, "sharded_variables", ())}

    def _check_same_run(self) -> None:
        """Refuses to resume a folder another run made; records this run's identity."""
        directory = self.directory
        current = identity(self.model, self.params, self._settings)
        has_checkpoints = bool(self._store.candidates())
        self._identity_notes = []
        try:
            recorded = read_identity(directory)
        except UnreadableIdentity as error:
            recorded = None
            self._identity_notes.append(f"{RUN_FILE} cannot be read ({str(error)[:120]}): the "
                                        f"run's settings were not compared, and are recorded "
                                        f"anew")
        else:
            if recorded is None and has_checkpoints:
                self._identity_notes.append(f"{RUN_FILE} is missing: the run's settings were "
                                            f"not compared, and are recorded anew")
        changes = differences(recorded, current) if has_checkpoints else []
        if changes and not self._resume_changed:
            raise ConfigError(f"checkpoint folder {directory} holds another run: "
                              f"{'; '.join(changes)}. Start fresh with another checkpoint "
                              f"folder (or delete this one), or resume it anyway with "
                              f"checkpoint.resume_changed=true. "
                              f"Received: checkpoint_dir={directory!r}")
        if changes:
            self._say(f"resuming {directory} although the run changed "
                      f"(checkpoint.resume_changed): {'; '.join(changes)}")
        if self._adapter.is_chief and recorded != current:
            record_identity(directory, current)

    def _resume_from_commit(self) -> None:
        """After a Horovod elastic reset: the commit is restored and broadcast already."""
        self._position.reload()
        metrics = _metric_variables(self.model)
        values = [variable.numpy() for variable in metrics]

        def put_back() -> None:
            for variable, value in zip(metrics, values):
                variable.assign(value)
            self._adapter.after_restore(metrics)

        self._put_back_metrics = put_back
        self._resume(f"resuming from the last commit with {self._adapter.num_processes} "
                     f"process(es)")

    @property
    def _speaks(self) -> bool:
        """This process prints status lines: the chief, or all with every_process_prints."""
        return self._adapter.is_chief or self._adapter.config.every_process_prints

    def _say(self, message: str) -> None:
        if self._speaks:
            print(f"tfdist: {message}", file=sys.stderr, flush=True)

    def _resume(self, how: str) -> None:
        """Continues from the position just restored, on the state just restored."""
        model = self.model
        partition = self._partition_ids()
        self._adapter.after_restore([variable for variable in list(model.variables) + (
            list(model.optimizer.variables) if model.optimizer is not None else [])
            if id(variable) not in partition])
        position = self._position
        self._saved_global_step = position.global_step
        self._saved_at = (position.epoch, position.step, position.global_step)
        self._resume_epoch, self._skip = position.epoch, position.step
        self.model._initial_epoch = position.epoch
        self._say(f"{how}: {position.describe()}")
        epochs = self.params.get("epochs") if self.params else None
        if isinstance(epochs, int) and position.epoch >= epochs:
            self._say(f"the run in {self.directory} finished all {position.epoch} epochs: "
                      f"nothing to train. Ask for more epochs to train it longer, or use "
                      f"another checkpoint folder to start a new run")
        if position.epoch or position.step:
            notice = self._pipelines.unreproducible()
            if notice:
                self._say(notice)
            self._pipelines.advance(position.epoch)

    def _skip_first_steps(self, count: int) -> None:
        """Makes the next `count` steps consume their batches without training on them.

        Keras counts the resumed epoch from its first step; the steps done before
        the checkpoint still take their batches from the data (so the rest of the
        epoch gets the batches it would have had) and reach callbacks, with the
        restored metrics as their logs, but do not train.
        """
        model = self.model
        train_function = self._train_function = model.train_function
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        remaining = count
        logs: dict[str, Any] = {}
        if count % per_call:
            logging.warning("tfdist: the checkpoint is at step %d, not a multiple of "
                            "steps_per_execution=%d (changed since it was saved?); the "
                            "epoch's last execution will be short", count, per_call)

        def skip_or_train(iterator: Any) -> Any:
            nonlocal remaining, logs
            if not logs:
                logs = {name: float(value)
                        for name, value in model.get_metrics_result().items()}
            for _ in range(min(per_call, remaining)):
                next(iterator)
            remaining -= per_call
            if remaining <= 0:
                model.train_function = train_function
            if remaining < 0:  # A short skip: train the rest of this execution.
                return train_function(iterator)
            return logs

        model.train_function = skip_or_train

    # --- saving and stopping ----------------------------------------------------------------

    def _save_due(self, done: int) -> bool:
        """Whether the schedule saves after `done` steps of this epoch (the same everywhere)."""
        every = self.save_every_steps
        if not every:
            return False
        global_step = self._position.global_step + done - self._position.step
        return global_step // every > max(self._saved_global_step, 0) // every

    def _save(self) -> None:
        position = self._position
        where = (position.epoch, position.step, position.global_step)
        if where == self._saved_at:
            return
        position.record()
        with self._adapter.prepare_checkpoint(self._summed_variables):
            if self._store is not None:
                if self._sharded is not None:
                    # Every rank's partition is on disk before the checkpoint that names it.
                    sharded_state.write_shard(self.directory, position.global_step,
                                              self._sharded.shard_rank, self._sharded.shard_ranks,
                                              self._sharded.shard_state())
                    self._adapter.barrier("tfdist_shards_written")
                path = self._store.save(position.global_step)
                if self._speaks:
                    logging.info("tfdist: saved %s (%s)", path, position.describe())
            if self._elastic is not None:
                self._elastic.save()
        self._saved_global_step, self._saved_at = position.global_step, where
        # A slow writer (the chief, say) must not leave the others waiting in a collective
        # long enough to time out: everyone leaves the save together.
        self._adapter.barrier("tfdist_saved")
        if self._sharded is not None and self._store is not None and self._adapter.is_chief:
            sharded_state.remove_other_than(self.directory, self._store.kept_numbers())
        if self._elastic is not None:
            # Horovod's driver may have announced new ranks: every rank raises here at
            # the same commit, and the elastic loop resets.
            self._elastic.check_host_updates()

    def _stop(self) -> None:
        self._save()
        where = f", saved to {self.directory}" if self.directory else ""
        self._say(f"preempted (SIGTERM): every process stopped at {self._position.describe()}"
                  f"{where}; exiting with status {RESTART_EXIT_CODE} to be restarted")
        self._watch.stopping_for_restart()
        self._release(deliver_signal=False)
        raise SystemExit(RESTART_EXIT_CODE)

    def _release(self, deliver_signal: bool = True) -> None:
        if self._agreement is not None:
            self._agreement.close()
            self._agreement = None
        if self._train_function is not None:
            self.model.train_function = self._train_function
            self._train_function = None
        self.model._initial_epoch = None
        if self._store is not None:
            self._store.close()
        if deliver_signal:
            self._watch.uninstall()


def _saved_objects(model: keras.Model, position: TrainingPosition) -> dict[str, Any]:
    """What a checkpoint holds, by name."""
    # The model's variables as a list: a Keras 3 model is not a trackable parent of its
    # layers' variables, and `variables` (unlike `weights`) includes the states of its
    # random-number generators (Dropout).
    objects = {"model": list(model.variables), "position": position,
               "metrics": _metric_variables(model)}
    if model.optimizer is not None:
        objects["optimizer"] = model.optimizer
    return objects


def _variables_of(group: Any) -> list[Any]:
    """The variables of one entry of `_saved_objects`."""
    if isinstance(group, TrainingPosition):
        return group.variables_to_save
    if isinstance(group, keras.optimizers.Optimizer):
        return list(group.variables)
    return list(group)


def _metric_variables(model: keras.Model) -> list[Any]:
    """The totals and counts of the model's metrics, in a fixed order."""
    return [variable for metric in model.metrics for variable in metric.variables]
