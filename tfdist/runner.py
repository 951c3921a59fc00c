"""Runner: config, then cluster, then adapter and precision, then ready to train.

The Runner is what a user holds. The user's own `model.fit` stays the training
loop; the Runner supplies the scope to build in, the optimizer, the dataset and
the callbacks that make that loop right under the chosen strategy.

Example:

    runner = tfdist.Runner(tfdist.load_config("mirrored"))
    with runner.scope():
        model = build_model()
        model.compile(optimizer=runner.optimizer(keras.optimizers.Adam(1e-3)),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(runner.dataset(train, global_batch_size=256), epochs=5,
              callbacks=runner.callbacks())
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import os
import shutil
import tempfile
from typing import Any, Iterator

from absl import logging

from tfdist import patches, registry
from tfdist.cluster import ClusterInfo, detect_cluster
from tfdist.config import Config, Strategy, load_config
from tfdist.dataset_checks import check_micro_batches, check_source
from tfdist.errors import MISSING_TENSORFLOW, ConfigError
from tfdist.files import atomic_write_text, writable_folder
from tfdist.precision import PrecisionPolicy, resolve_precision
from tfdist.resume.inputs import ResumeInputs
from tfdist.startup import configure_threads, warn_if_untrusted_network


def choose_strategy(cluster: ClusterInfo) -> tuple[Strategy, str]:
    """What `strategy: auto` picks on this machine, and why.

    Args:
        cluster: What detection found.

    Returns:
        The strategy, and one line saying why.
    """
    if cluster.tpu is not None:
        return Strategy.TPU, f"a TPU was found ({cluster.tpu.source})"
    if cluster.tf_config is not None and "ps" in cluster.tf_config.cluster:
        return Strategy.PARAMETER_SERVER, "TF_CONFIG names parameter servers"
    if cluster.tf_config is not None and cluster.tf_config.num_workers > 1:
        return Strategy.MULTI_WORKER, f"TF_CONFIG names {cluster.tf_config.num_workers} workers"
    if cluster.mpi is not None and cluster.mpi.size > 1:
        return Strategy.HOROVOD, f"{cluster.mpi.launcher} started {cluster.mpi.size} ranks"
    if cluster.slurm is not None and cluster.slurm.num_tasks > 1:
        return Strategy.MULTI_WORKER, f"Slurm started {cluster.slurm.num_tasks} tasks"
    if len(cluster.gpus) > 1:
        return Strategy.MIRRORED, f"{len(cluster.gpus)} GPUs were found"
    if cluster.gpus:
        return Strategy.ONE_DEVICE, "one GPU was found"
    return Strategy.ONE_DEVICE, "no GPU or TPU was found: the CPU"


class Runner:
    """Turns a config into a strategy, a precision policy and the pieces `model.fit` needs.

    Args:
        config: The run's config. None: `load_config()` defaults.
        cluster: Detection results. None: `detect_cluster()` reads this process's
            environment.

    Raises:
        ConfigError: a strategy, device or precision this machine cannot provide.

    Example:

        runner = Runner(load_config(overrides={"strategy": "one_device"}))
        runner.num_replicas, runner.is_chief   # (1, True)
    """

    def __init__(self, config: Config | None = None, *, cluster: ClusterInfo | None = None):
        if importlib.util.find_spec("tensorflow") is None:
            raise ModuleNotFoundError(MISSING_TENSORFLOW, name="tensorflow")
        config = load_config() if config is None else config
        if not isinstance(config, Config):
            raise ConfigError("Runner needs a tfdist.Config; build one with tfdist.load_config(). "
                              f"Received: {type(config).__name__}")
        self.cluster = detect_cluster() if cluster is None else cluster
        if config.strategy is Strategy.AUTO:
            strategy_name, reason = choose_strategy(self.cluster)
            self.strategy_reason = f"auto: {reason}"
        else:
            strategy_name, self.strategy_reason = config.strategy, "requested"
        adapter_cls = registry.get(strategy_name)
        self.precision: PrecisionPolicy = resolve_precision(
            config.precision, strategy=strategy_name, cluster=self.cluster)
        # The resolved config: what actually runs, written beside the run's outputs.
        self.config = dataclasses.replace(config, strategy=strategy_name,
                                          precision=self.precision.precision)
        self._adapter = adapter_cls(self.config, self.cluster)
        warn_if_untrusted_network(self._adapter.server_addresses(), config.trusted_network)
        self._resume = ResumeInputs()
        configure_threads(config.threads, default_inter_op=self._adapter.inter_op_threads(),
                          default_intra_op=self._adapter.intra_op_threads())
        if config.seed is not None:
            import keras

            keras.utils.set_random_seed(config.seed)
        self.strategy = self._adapter.strategy
        # The devices this process spreads one model over (model_parallel.devices > 1):
        # `scope()` hands them to tfdist.parallel's layers.
        self.model_devices: tuple[str, ...] = self._adapter.model_devices
        if config.every_process_prints:
            patches.keras_callbacks.PROGRESS_ON_THE_CHIEF.undo()
        if self.speaks:
            logging.info("tfdist: strategy %s (%s)", strategy_name.value, self.strategy_reason)
            logging.info("tfdist: precision %s (%s)", self.precision.name,
                         self.precision.reason)
            logging.info("tfdist: patches active: %s", ", ".join(patches.active()) or "none")

    def summary(self) -> str:
        """One line: the strategy, its replicas and why, the precision and why.

        Example:

            print(runner.summary(), file=sys.stderr)
            # tfdist: strategy mirrored (2 replicas; requested), precision float32 (the default)
        """
        replicas = f"{self.num_replicas} replica{'' if self.num_replicas == 1 else 's'}"
        return (f"tfdist: strategy {self.strategy_name.value} ({replicas}; "
                f"{self.strategy_reason}), precision {self.precision.name} "
                f"({self.precision.reason})")

    @classmethod
    def from_flags(cls, flag_values: Any = None) -> "Runner":
        """Builds a Runner from tfdist's absl flags, once they are parsed (inside `main`).

        tfdist's flags are defined by `from tfdist import flags`, which must run before
        absl parses the command line: at the top of the script.

        Args:
            flag_values: The `absl.flags.FlagValues` holding tfdist's flags. None: the
                global `FLAGS`.

        Raises:
            ConfigError: tfdist's flags were not defined when the command line was parsed.

        Example:

            from tfdist import flags as tfdist_flags   # at the top: defines the flags

            def main(argv):
                runner = tfdist.Runner.from_flags()

            tfdist_flags.run(main)
        """
        from absl import flags as absl_flags

        values = absl_flags.FLAGS if flag_values is None else flag_values
        if "strategy" not in values or not values.is_parsed():
            raise ConfigError("Runner.from_flags() reads tfdist's absl flags, which `from tfdist "
                              "import flags` defines: put that import at the top of the script, "
                              "before app.run parses the command line, and call from_flags "
                              "inside main. Received: "
                              + ("no tfdist flags defined" if "strategy" not in values
                                 else "flags not parsed yet"))
        from tfdist import flags as tfdist_flags

        return cls(tfdist_flags.config_from_flags(values))

    @property
    def strategy_name(self) -> Strategy:
        """The concrete strategy in use (what `auto` chose, if asked)."""
        return self.config.strategy

    @property
    def num_replicas(self) -> int:
        """Replicas that train in sync, across all processes."""
        return self._adapter.num_replicas

    @property
    def is_chief(self) -> bool:
        """Whether this process writes logs, checkpoints and the resolved config."""
        return self._adapter.is_chief

    @property
    def speaks(self) -> bool:
        """Whether this process prints progress bars and tfdist's status lines: the chief,
        or every process with `every_process_prints: true` (warnings and errors: all)."""
        return self.is_chief or self.config.every_process_prints

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Build and compile the model inside this block.

        It enters the strategy's scope, so variables are placed by the strategy, and
        sets Keras's dtype policy, so layers compute in the run's precision. The
        previous global dtype policy is restored on exit. With `model_parallel.devices`
        > 1, `tfdist.parallel`'s layers built inside take `model_devices` and
        `model_parallel.micro_batches`.
        """
        from tfdist.parallel.placement import use_devices

        placement = (use_devices(self.model_devices, self.config.model_parallel.micro_batches)
                     if self.model_devices else contextlib.nullcontext())
        with (self.precision.applied(), self.strategy.scope(), placement,
              self._adapter.creation_scope()):
            yield

    def optimizer(self, optimizer: Any) -> Any:
        """Returns the optimizer to pass to `model.compile`.

        Keras's TensorFlow optimizers belong to the strategy they were constructed
        under, and `model.fit` fails ("Mixing different tf.distribute.Strategy
        objects") when that is not the model's. So an optimizer that has not taken a
        step yet is re-created from its config inside this strategy's scope, and may
        be constructed anywhere.

        An optimizer that has taken steps (`model.optimizer` of a model loaded from a
        `.keras` file under `runner.scope()`, say) keeps its state: iterations, slots, the
        loss scale (its growth counter starts again).

        Args:
            optimizer: A `keras.optimizers.Optimizer`, or an identifier Keras accepts
                (`"adam"`, a config dict).

        Returns:
            The optimizer, wrapped for what the strategy needs, for gradient
            accumulation when `accumulation_steps` > 1, and for loss scaling under
            mixed_float16 (see `tfdist.optimizers`).
        """
        import keras

        from tfdist.accumulation import AccumulatingOptimizer
        from tfdist.optimizers import recreated

        with self.strategy.scope():
            try:
                optimizer = keras.optimizers.get(optimizer)
            except ValueError as error:
                raise ConfigError(f"runner.optimizer needs a Keras optimizer or its name, such "
                                  f"as keras.optimizers.Adam(1e-3) or 'adam' ({error}). "
                                  f"Received: {optimizer!r}") from None
            if not optimizer.built and int(optimizer.iterations.numpy()) == 0:
                optimizer = recreated(optimizer)
            loss_scale_options = {}
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                # The user's own loss scaling keeps its settings, but goes outermost,
                # where the strategy can make its skip decisions agree.
                # A trained one (loaded from a `.keras` file) goes on from its scale.
                scale = (float(optimizer.dynamic_scale.numpy()) if optimizer.built
                         else optimizer.initial_scale)
                loss_scale_options = {"initial_scale": scale,
                                      "dynamic_growth_steps": optimizer.dynamic_growth_steps}
                optimizer = optimizer.inner_optimizer
            optimizer = self._adapter.wrap_optimizer(optimizer)
            if self.config.accumulation_steps > 1:
                optimizer = AccumulatingOptimizer(optimizer, steps=self.config.accumulation_steps)
            return self.precision.wrap_optimizer(
                optimizer, finite_reduce_fn=self._adapter.finite_reduce_fn(),
                **loss_scale_options)

    def dataset(self, source: Any, global_batch_size: int, *, drop_remainder: bool = True,
                shuffle_buffer_size: int = 0) -> Any:
        """Batches and places unbatched data as the strategy needs.

        Step i consumes the same examples under every strategy: those of step i
        under `one_device` with the same global batch.

        A run that resumes gets each epoch's order back either way: this shuffle's
        order is fixed by (seed, epoch), and a seeded `tf.data` shuffle in the
        source is replayed to the resumed epoch's order (see `tfdist.resume.shuffling`).

        Args:
            source: An unbatched `tf.data.Dataset`, or a function of
                `tf.distribute.InputContext` returning one.
            global_batch_size: Examples per step (one forward pass) across all
                replicas; must divide by `num_replicas`. With `accumulation_steps` k
                this is the micro-batch, and each update is over k times as many.
            drop_remainder: Drop a final partial batch (the default, so every step's
                gradient is the mean over a full global batch). False suits evaluation.
            shuffle_buffer_size: Shuffle each epoch with a buffer of this many
                examples, in the order of (`seed`, epoch), the same on every
                process (0: keep the source's order). The source's length shuffles
                it uniformly.

        Returns:
            What to pass to `model.fit`, `model.evaluate` or `model.predict`.

        Raises:
            ConfigError: the batch does not divide across replicas; the source is not a
                dataset, is batched already, or holds less than one global batch (with
                `drop_remainder`): see `tfdist.dataset_checks`.
        """
        check_source(source, global_batch_size, drop_remainder)
        check_micro_batches(global_batch_size, self.num_replicas,
                            self.config.model_parallel.micro_batches)
        shuffle = None
        if shuffle_buffer_size:
            if (not isinstance(shuffle_buffer_size, int) or isinstance(shuffle_buffer_size, bool)
                    or shuffle_buffer_size < 0):
                raise ConfigError(f"shuffle_buffer_size must be an integer >= 0 (0: no "
                                  f"shuffle). Received: shuffle_buffer_size="
                                  f"{shuffle_buffer_size!r}")
            shuffle = self._resume.epoch_shuffle(shuffle_buffer_size, seed=self.config.seed or 0)
        return self._resume.track(self._adapter.distribute_dataset(
            source, global_batch_size, drop_remainder=drop_remainder, shuffle=shuffle))

    def callbacks(self, checkpoint_dir: str | os.PathLike | None = None, *,
                  save_every_steps: int | None = None, keep: int | None = None) -> list[Any]:
        """Keras callbacks to add to `model.fit` for this strategy.

        Args:
            checkpoint_dir: Where to keep checkpoints for an exact resume, shared by
                every process. A run started again with the same folder goes on from
                its newest good checkpoint, at the step after it (see
                `tfdist.resume.backup.BackupAndRestore`); a SIGTERM to any process makes
                every process save at one agreed step and exit with status 143.
                None: `checkpoint.dir` from the config (empty: no checkpoints).
            save_every_steps: Also save every this many steps (0: at epoch ends
                only). None: `checkpoint.save_every_steps`.
            keep: Checkpoints kept. None: `checkpoint.keep`.

        Returns:
            The callbacks: first the check that the model was created under
            `runner.scope()` (`tfdist.callbacks.StrategyScopeCheck`), then the
            checkpoint's (it restores before the others start).

        Example:

            model.fit(data, epochs=5, callbacks=runner.callbacks(checkpoint_dir="ckpt",
                                                                 save_every_steps=100))
        """
        options = self.config.checkpoint
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
            raise ConfigError("checkpoint_dir must be a folder's path (a str or a pathlib.Path). "
                              f"Received: checkpoint_dir={checkpoint_dir!r}")
        directory = options.dir if checkpoint_dir is None else os.fspath(checkpoint_dir)
        from tfdist.callbacks import StrategyScopeCheck

        if directory and self.is_chief:
            writable_folder(directory, "checkpoint_dir")  # Now, not at the first save.
        backup = self._resume.backup(
            directory or None, self._adapter,
            save_every_steps=(options.save_every_steps if save_every_steps is None
                              else save_every_steps),
            keep=options.keep if keep is None else keep, grace_seconds=options.grace_seconds,
            settings={"accumulation_steps": self.config.accumulation_steps,
                      "precision": self.precision.name, "seed": self.config.seed},
            resume_changed=options.resume_changed)
        return [StrategyScopeCheck(self.strategy), *([backup] if backup else []),
                *self._adapter.callbacks()]

    def run_elastic(self, train: Any) -> Any:
        """Runs `train()` under Horovod elastic: it goes on with the ranks left when one is lost.

        Start the job with `horovodrun --min-np N ...` (with a host discovery script,
        or `-H` naming at least two hosts). Every `runner.callbacks()` save point also
        commits the state in memory (with or without a `checkpoint_dir`). When a rank
        fails, the others restore the last commit, Horovod restarts with the ranks
        left, and `train()` is called again: its `fit` resumes from the commit, each
        rank's slice of the global batch follows the new number of ranks, and so does
        `horovod.scale_learning_rate`'s multiplier. Call `runner.dataset` and
        `runner.callbacks` inside `train`, so they are made for the current ranks.

        Args:
            train: A function of no arguments that calls `model.fit`.

        Returns:
            What `train` returns, once it has returned.

        Raises:
            ConfigError: the strategy is not horovod.

        Example:

            def train():
                model.fit(runner.dataset(ds, 64), epochs=5,
                          callbacks=runner.callbacks(save_every_steps=50))

            runner.run_elastic(train)
        """
        if self.config.zero_stage:
            raise ConfigError(f"run_elastic cannot re-partition sharded training state when ranks "
                              f"leave or join; set zero_stage 0 for elastic training, or keep "
                              f"zero_stage with a fixed number of ranks and checkpoints. "
                              f"Received: zero_stage={self.config.zero_stage}")

        def train_with(state: Any) -> Any:
            with self._resume.committing_to(state):  # runner.callbacks() inside `train`.
                return train()

        return self._adapter.run_elastic(train_with)

    def writable_dir(self, directory: str | os.PathLike) -> str:
        """Where this process writes what only the chief should keep.

        Some writers must run on every worker (a checkpoint of mirrored variables,
        for one), but only the chief's files should remain. The chief gets
        `directory`; every other process gets a private temporary folder, removed
        when the process exits.

        Args:
            directory: The run's folder for these files.

        Example:

            keras.callbacks.TensorBoard(runner.writable_dir("runs/a/tensorboard"))
        """
        if self.is_chief:
            os.makedirs(directory, exist_ok=True)
            return os.fspath(directory)
        scratch = tempfile.mkdtemp(prefix="tfdist-not-chief-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        return scratch

    def save_config(self, directory: str | os.PathLike) -> str | None:
        """Writes the resolved config to `directory/config.yaml`, on the chief only.

        Returns:
            The path written, or None on processes other than the chief.
        """
        if not self.is_chief:
            return None
        return atomic_write_text(os.path.join(os.fspath(directory), "config.yaml"),
                                 self.config.to_yaml())
