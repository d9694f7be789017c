"""The progress bars of an evaluation: one per task and variant, named ``VARIANT: TASK`` while a variant runs."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_VARIANT: ContextVar[str | None] = ContextVar("evaluated_variant", default=None)


@contextmanager
def variant_running(name: str) -> Iterator[None]:
    """The bars opened inside are named after the variant ``name`` (``dense``, ``quest@1024``, ...)."""
    token = _VARIANT.set(name)
    try:
        yield
    finally:
        _VARIANT.reset(token)


def progress_bar(total: int, desc: str, unit: str):
    """A transient tqdm bar of ``total`` ``unit``s named ``VARIANT: desc`` (``desc`` alone outside a variant)."""
    from tqdm.auto import tqdm

    variant = _VARIANT.get()
    return tqdm(total=total, desc=f"{variant}: {desc}" if variant else desc, unit=unit, leave=False)
