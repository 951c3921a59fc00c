"""Exact resume under `model.fit`: what a crash, a preemption or a restart must not change.

- `backup`: the `BackupAndRestore` callback `runner.callbacks(checkpoint_dir=...)` gives:
  saves, the restore at the exact step, the stop after SIGTERM.
- `checkpointing`: the checkpoint folder: atomic saves, the newest kept, torn ones passed over.
- `preemption`: SIGTERM, the one step every process stops at, exit status 143.
- `shuffling`: data order at a resume: tfdist's shuffle fixed by (seed, epoch), and the
  user's own seeded shuffles replayed to the resumed epoch's order.
"""
