"""What makes a checkpoint folder's run the same run: resume it, never another one.

A checkpoint folder records, beside its checkpoints, what the run that made it trains
(`run.json`): the model's variables (names, shapes, dtypes), the optimizer's class and
settings (learning rate or schedule, betas, weight decay, clipping), the steps per epoch
(the data and the batch), the epochs, and the caller's settings (tfdist's
`accumulation_steps`, precision and seed). A run started with that folder resumes only
when these match; more epochs than recorded is the same run trained longer. Otherwise
it stops with one line naming each difference, and how to start fresh or resume anyway
(`checkpoint.resume_changed`).

Example:

    recorded = read_identity("ckpt")               # None: nothing recorded yet
    changes = differences(recorded, identity(model, {"epochs": 5, "steps": 100}, {}))
    # ["optimizer.learning_rate: 0.001 -> 0.01", "epochs: 5 -> 3 (fewer)"]
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from tfdist.files import atomic_write_text

RUN_FILE = "run.json"


def identity(model: Any, params: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies the run `model.fit` is starting.

    Args:
        model: The Keras model, built, with its optimizer.
        params: The fit's `Callback.params` (`epochs`, `steps`).
        settings: The caller's own settings that change what trains (plain values).
    """
    described: dict[str, Any] = {
        "model": [f"{variable.path} {list(variable.shape)} {variable.dtype}"
                  for variable in model.weights],
        "steps_per_epoch": params.get("steps"),
        "epochs": params.get("epochs"),
    }
    optimizer = _innermost(model.optimizer)
    if optimizer is not None:
        described["optimizer"] = {"class": type(optimizer).__name__,
                                  **_plain(optimizer.get_config())}
        described["optimizer"].pop("name", None)
    described.update(_plain(dict(settings)))
    return described


def differences(recorded: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[str]:
    """Each way `current` is another run than `recorded`, one short phrase each.

    More epochs than recorded is not a difference: that is the run trained longer.
    """
    if recorded is None:
        return []
    found = []
    for key in sorted(set(recorded) | set(current)):
        before, now = recorded.get(key), current.get(key)
        if before == now:
            continue
        if key == "epochs" and isinstance(before, int) and isinstance(now, int):
            if now > before:
                continue
            found.append(f"epochs: {before} -> {now} (fewer)")
        elif key == "model":
            found.append(f"the model's variables ({len(before or [])} -> {len(now or [])}, "
                         f"first change: {_first_change(before or [], now or [])})")
        elif isinstance(before, Mapping) and isinstance(now, Mapping):
            for name in sorted(set(before) | set(now)):
                if before.get(name) != now.get(name):
                    found.append(f"{key}.{name}: {_short(before.get(name))} -> "
                                 f"{_short(now.get(name))}")
        else:
            found.append(f"{key}: {_short(before)} -> {_short(now)}")
    return found


class UnreadableIdentity(ValueError):
    """`run.json` is there but is not what `record_identity` writes (truncated, damaged)."""


def read_identity(directory: str) -> dict[str, Any] | None:
    """The identity recorded in `directory`, or None if none was.

    Raises:
        UnreadableIdentity: the file is there but does not read as a recorded identity;
            its message says why in a few words.
    """
    try:
        with open(os.path.join(directory, RUN_FILE), encoding="utf-8") as stream:
            recorded = json.load(stream)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError
        raise UnreadableIdentity(f"{type(error).__name__}: {error}") from None
    if not isinstance(recorded, dict):
        raise UnreadableIdentity(f"holds a {type(recorded).__name__}, not a run's settings")
    return recorded


def record_identity(directory: str, described: Mapping[str, Any]) -> None:
    """Records `described` in `directory` (atomically: a reader sees the old or the new)."""
    atomic_write_text(os.path.join(directory, RUN_FILE),
                      json.dumps(described, indent=1, sort_keys=True) + "\n")


def _innermost(optimizer: Any) -> Any:
    """The user's optimizer inside tfdist's and Keras's wrappers (loss scaling, accumulation)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


def _plain(value: Any) -> Any:
    """JSON's types only: what cannot be said in JSON is said by its type's name."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, float):
        # Keras keeps settings such as the learning rate in float32 variables: 0.01 comes
        # back as 0.009999999776; 7 significant digits are what float32 holds.
        return float(f"{value:.7g}") if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # NumPy and TensorFlow scalars
        return _plain(value.item())
    return type(value).__name__


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _first_change(before: list[str], now: list[str]) -> str:
    for old, new in zip(before, now):
        if old != new:
            return f"{old} -> {new}"
    longer = before if len(before) > len(now) else now
    return f"{'removed' if longer is before else 'added'} {longer[min(len(before), len(now))]}"
