"""The gradient-accumulation window: what the backwards since the last synchronising one
used (:class:`UsedWindow`).

Under the wrapper's ``no_sync()`` (FSDP2's ``set_requires_gradient_sync(False)``,
DeepSpeed before its boundary) a backward reduces nothing: the wrapper adds up the
window's gradients and the synchronising backward reduces the sum. So that reduction's
masks, and what the views are handed at its end, join what every backward of the window
used with what the last one did, per segment of each flat parameter and per plain
parameter (every adapter's window is kept here). While a window is open the views keep
the gradients they had before it (the flat gradients hold the window's, unmerged).
"""

from __future__ import annotations

Used = tuple[bool, ...]
"""Per segment of one flat parameter, whether a backward used it."""


class UsedWindow:
    """The *used* flags of the backwards since the last synchronising one."""

    def __init__(self) -> None:
        self._flats: list[Used] | None = None
        self._plain: frozenset[int] = frozenset()

    @property
    def open(self) -> bool:
        """A backward under ``no_sync()`` ran since the last synchronising one."""
        return self._flats is not None

    def join(self, flat: int, now: Used) -> Used:
        """``now`` (flat parameter ``flat``'s flags in this iteration) joined with the
        window's."""
        if self._flats is None:
            return now
        return tuple(a or b for a, b in zip(self._flats[flat], now, strict=True))

    def join_plain(self, used: frozenset[int]) -> frozenset[int]:
        """``used`` (plain parameters of this iteration) joined with the window's: the
        same object where the window holds none, which callers key caches by (it repeats
        with the skip set)."""
        return self._plain | used if self._plain else used

    def extend(self, flats: list[Used], plain: frozenset[int]) -> None:
        """A backward under ``no_sync()`` ended: ``flats`` and ``plain``, already joined
        with the window's, are what it holds now."""
        self._flats = flats
        self._plain = plain

    def close(self) -> None:
        """A synchronising backward reduced the window's sum."""
        self._flats = None
        self._plain = frozenset()

    def forget_plain(self) -> None:
        """The plain parameters' part is over before the backward ends (reduced, or
        dropped)."""
        self._plain = frozenset()

    def forget(self) -> None:
        """The wrapper dropped what it accumulated: nothing counts as used any more, and
        the window stays open."""
        if self._flats is not None:
            self._flats = [(False,) * len(used) for used in self._flats]
        self._plain = frozenset()
