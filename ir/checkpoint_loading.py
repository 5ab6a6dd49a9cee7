"""A checkpoint that does not match the model is an error, not a model partly made of random values.

transformers' `from_pretrained` loads what matches and only logs the rest: a key of the model the
checkpoint lacks starts from its random initialisation, a key of the checkpoint the model lacks is
dropped. A model file that loads the wrong folder (another size, another architecture) would then
compile and train a model nobody asked for. While `checked_checkpoint_loads()` is open (the compiler
and the run's weight staging call build_model() inside it), every `from_pretrained` of a transformers
model reports what it loaded (transformers' own accounting: tied weights and the keys a class expects
to be missing or unused are not counted) and any difference raises `CheckpointMismatch`, naming the
first key. transformers is patched only if the model file imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CheckpointMismatch(ValueError):
    """A checkpoint that does not match the model build_model() returns."""


def mismatch(info: dict[str, Any], source: object) -> str | None:
    """One line about the first difference in transformers' loading info, or None."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    where = f"from_pretrained({str(source)!r})"
    if mismatched:
        key, have, want = mismatched[0]
        return (
            f"{where}: the checkpoint's {key!r} is {list(have)}, the model's is {list(want)} "
            f"({len(mismatched)} such key(s)); the checkpoint is not of this model's configuration"
        )
    if missing:
        return (
            f"{where}: the checkpoint has no {missing[0]!r} ({len(missing)} key(s) of the model it lacks, which "
            "would start from random values); load the checkpoint of this model, or build the missing part "
            "after loading (and say so in the model file)"
        )
    if unexpected:
        return (
            f"{where}: the model has no {unexpected[0]!r} ({len(unexpected)} key(s) of the checkpoint it does not "
            "use); the checkpoint is of another model"
        )
    return None


@contextmanager
def checked_checkpoint_loads() -> Iterator[None]:
    """While open, a transformers `from_pretrained` whose checkpoint does not match its model raises
    CheckpointMismatch (see the module's docstring); outside, transformers is as it was."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    original = base.__dict__.get("from_pretrained") if base is not None else None
    if base is None or not isinstance(original, classmethod):
        yield
        return
    load = original.__func__

    def checked(cls: type, source: object, *args: Any, **kwargs: Any) -> Any:
        wanted = kwargs.pop("output_loading_info", False)
        model, info = load(cls, source, *args, output_loading_info=True, **kwargs)
        problem = mismatch(info, source)
        if problem is not None:
            raise CheckpointMismatch(problem)
        return (model, info) if wanted else model

    base.from_pretrained = classmethod(checked)
    try:
        yield
    finally:
        base.from_pretrained = original
