"""`Patch`: one replacement of one attribute of Keras, TensorFlow or Horovod.

A patch knows what it replaces (an attribute of a module or class, found when it is
applied, so defining a patch imports nothing), what it puts there, how to tell that
the upstream bug is still in the installed code, and which upstream issue it works
around. Applying is idempotent and thread-safe; `undo` puts back exactly what was
there, including removing an attribute the class only inherited.

Example:

    from tfdist import patches

    patches.keras_trainer.MULTI_WORKER_METRIC_REDUCTION.apply()   # True: applied now
    patches.active()          # ["keras.trainer.multi_worker_metric_reduction"]
    patches.keras_trainer.MULTI_WORKER_METRIC_REDUCTION.undo()
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
from typing import Any, Callable, Iterator

# One lock for every patch: applying one reads and writes classes other patches may
# touch too (Keras's trainer holds three of them).
_lock = threading.RLock()
_registry: dict[str, "Patch"] = {}
# Counts applications: two patches of one attribute stack, and only the one applied
# last can be undone first (`undo` sorts by it).
_applications = itertools.count()


class Patch:
    """Replaces `owner().attribute` with `replacement(original)` while the bug is present.

    Args:
        name: Dotted, unique: `<component>.<what it fixes>`, as `tfdist env` lists it.
        owner: Returns the module or class that holds the attribute; called when the
            patch is applied or checked, never when it is defined.
        attribute: The attribute's name.
        replacement: Takes the original and keyword parameters given to `apply`, and
            returns what goes in its place. A function it returns should call the
            original wherever the bug does not apply.
        bug_present: Takes the original and says whether the installed code still has
            the bug, read from that code (its source or its behaviour), never from a
            version number. False means the patch is not applied.
        upstream: The upstream issue (`owner/repo#N`), or why there is none.
        summary: One line: what goes wrong without the patch.

    Example:

        ATOMIC = Patch("keras.variables.atomic_assign_add",
                       owner=lambda: keras_variable_class(), attribute="assign_add",
                       replacement=make_atomic, bug_present=reads_then_writes,
                       upstream="keras-team/keras#18624",
                       summary="assign_add is a read then a write: updates are lost")
    """

    def __init__(self, name: str, *, owner: Callable[[], Any], attribute: str,
                 replacement: Callable[..., Any], bug_present: Callable[[Any], bool],
                 upstream: str, summary: str):
        if name in _registry:
            raise ValueError(f"a patch named {name!r} exists already")
        self.name, self.attribute = name, attribute
        self.upstream, self.summary = upstream, summary
        self._owner, self._replacement, self._bug_present = owner, replacement, bug_present
        # While applied: (owner, original, whether the owner held the attribute itself,
        # the replacement installed).
        self._applied: tuple[Any, Any, bool, Any] | None = None
        self._application = -1  # When it was last applied: see `application`.
        # Held for the whole of `applied()`: a temporary patch belongs to one caller.
        self._scope_lock = threading.Lock()
        _registry[name] = self

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return f"<Patch {self.name} ({self.upstream}) {state}>"

    @property
    def active(self) -> bool:
        """Whether the replacement is in place now."""
        return self._applied is not None

    def original(self) -> Any:
        """What the owner's attribute is without this patch."""
        with _lock:
            if self._applied is not None:
                return self._applied[1]
            return inspect.getattr_static(self._owner(), self.attribute)

    def bug_present(self) -> bool:
        """Whether the installed Keras/TensorFlow/Horovod still has the bug."""
        return bool(self._bug_present(self.original()))

    def apply(self, **parameters: Any) -> bool:
        """Puts the replacement in place if the bug is present and it is not there yet.

        Args:
            **parameters: Passed to `replacement` (for patches that take a setting).

        Returns:
            True if applied by this call; False if active already or not needed.
        """
        with _lock:
            if self._applied is not None:
                return False
            owner = self._owner()
            original = inspect.getattr_static(owner, self.attribute)
            if not self._bug_present(original):
                return False
            replacement = self._replacement(original, **parameters)
            if callable(replacement) and not isinstance(replacement, type):
                replacement.__wrapped__ = original
                replacement.__tfdist_patch__ = self.name
            owned = self.attribute in vars(owner)
            setattr(owner, self.attribute, replacement)
            self._applied = (owner, original, owned, replacement)
            self._application = next(_applications)
            return True

    @property
    def application(self) -> int:
        """Increases with each `apply` of any patch: the undo order, last first."""
        return self._application

    def undo(self) -> bool:
        """Puts back what was there before `apply`.

        Returns:
            True if undone by this call; False if it was not active.

        Raises:
            RuntimeError: someone replaced the attribute again after this patch; undoing
                would throw their replacement away.
        """
        with _lock:
            if self._applied is None:
                return False
            owner, original, owned, replacement = self._applied
            if inspect.getattr_static(owner, self.attribute) is not replacement:
                raise RuntimeError(f"{self.name}: {owner.__name__}.{self.attribute} was "
                                   f"replaced again after tfdist patched it; undo that first")
            if owned:
                setattr(owner, self.attribute, original)
            else:
                delattr(owner, self.attribute)
            self._applied = None
            return True

    @contextlib.contextmanager
    def applied(self, **parameters: Any) -> Iterator[bool]:
        """Applies the patch for the block only; one block at a time across threads.

        For patches needed only while something is built (a strategy reads a class
        attribute in its constructor). Yields whether the patch is in place.
        """
        with self._scope_lock:
            applied_here = self.apply(**parameters)
            try:
                yield applied_here or self.active
            finally:
                if applied_here:
                    self.undo()


def registered() -> list[Patch]:
    """Every patch tfdist defines, in definition order."""
    return list(_registry.values())


def source_contains(obj: Any, text: str) -> bool:
    """Whether `obj`'s Python source contains `text` (False where there is no source).

    The bug checks read the installed code: a release that fixes the bug changes the
    lines they look for, and the patch then stays off. A test checks that every check
    still matches the installed Keras and TensorFlow.
    """
    try:
        return text in inspect.getsource(inspect.unwrap(obj))
    except (OSError, TypeError):
        return False
