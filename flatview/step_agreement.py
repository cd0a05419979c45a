"""The skip-set agreement check of the iteration in flight: :class:`SkipAgreement`.

With ``check_skip_agreement`` on, every checked step, and every iteration outside any
step (as one skipping nothing), is checked with one tiny all-gather of a fingerprint of
its skip set and frozen parameters (:mod:`flatview.comm.agreement`), on the adapter's
``agreement_group`` (every rank of the run, replicas included). Where the adapter allows
(``overlaps_agreement``) it runs alongside the forward and is settled before the first
collective the skip set decides; otherwise it is settled at once.

Units on process groups of their own (experts, :class:`~flatview.backends.base.UnitGroup`)
have a fingerprint of their own in the same all-gather: only the ranks that share such a
group must skip their parameters alike.

An iteration whose backward does not synchronise (under the wrapper's ``no_sync()``, as
:meth:`~flatview.backends.base.Adapter.synchronizing` says when the step is entered, or
the outside-step forward begins) exchanges nothing: the wrapper makes such a micro-step
free of gradient communication and flatview keeps it so. Its declaration is kept, and the
check of the next synchronising iteration covers all of them at once (one fingerprint of
the sequence): a disagreement in any of them raises on every rank before that
iteration's first collective the skip set decides, so before any reduction of what the
micro-steps accumulated. What a deferred check cannot do is catch the disagreement
earlier: on sharded wrappers the micro-steps' forwards have gathered parameters by
their own skip sets already (``docs/limitations.md``). A rank whose skip set fails to
resolve in such a step raises at once, alone, and reports it at that check, where every
rank raises. A step entered with ``check=True`` given explicitly is checked at once
(with the declarations waiting before it), under ``no_sync()`` too: one tiny all-gather
more, for a disagreement found before the wrapper's gathers can pair up wrongly.
"""

from __future__ import annotations

from flatview.backends.base import Adapter
from flatview.comm.agreement import Agreement, Declared, combined, fingerprint
from flatview.comm.ledger import Ledger
from flatview.errors import FlatViewError
from flatview.table import ParamTable

PRINTS_CACHE = 256
"""Fingerprint pairs kept (skip sets may vary every step)."""

_Entry = tuple[frozenset[int], frozenset[int], bool]
"""One iteration's declaration: skipped and frozen parameters, outside any step."""


class SkipAgreement:
    """The check in flight, if any, and the declarations it will cover (see the module
    docstring)."""

    def __init__(self, table: ParamTable, adapter: Adapter, ledger: Ledger) -> None:
        self.table = table
        self.adapter = adapter
        self.ledger = ledger
        self._pending: Agreement | None = None
        self._prints: dict[tuple[frozenset[int], frozenset[int]], tuple[int, ...]] = {}
        """Per (skipped, frozen) pair seen lately, its fingerprints (:meth:`_prints_of`)."""
        # Declarations of iterations under no_sync(), and the first failure among them:
        # the next synchronising iteration's check covers them.
        self._deferred: list[_Entry] = []
        self._deferred_failure: FlatViewError | None = None
        self.failed_outside = False
        """The last :meth:`settle` raised for an iteration outside any step."""
        everything = frozenset(range(len(table)))
        own = table.own_group_params
        self._slots = (everything,) if table.peers is None else (everything - own, own)

    def start(
        self,
        skipped: frozenset[int],
        *,
        failure: FlatViewError | None = None,
        outside: bool = False,
        at_once: bool = False,
    ) -> bool:
        """Check a step skipping ``skipped`` (``failure``: this rank's own error, sent in
        place of its fingerprint), or an iteration ``outside`` any step. Returns whether
        a check started: under ``no_sync()`` it waits for the next synchronising
        iteration (``failure`` is then raised here, on this rank alone), unless asked
        for ``at_once``."""
        frozen = self.table.frozen()
        entry = (skipped, frozen, outside)
        if not at_once and not self.adapter.synchronizing():
            self._deferred.append(entry)
            if failure is not None:
                self._deferred_failure = self._deferred_failure or failure
                raise failure
            return False
        self._check([*self._deferred, entry], failure, outside)
        return True

    @property
    def deferred(self) -> bool:
        """Iterations under ``no_sync()`` wait for a check."""
        return bool(self._deferred)

    def cover_deferred(self) -> None:
        """If a backward synchronises while iterations still wait (its step began under
        ``no_sync()``), check them at once: the runtime calls this before the backward's
        first reduction, which every rank that synchronises reaches alike."""
        if self._deferred and self.adapter.synchronizing():
            self._check(list(self._deferred), None, False, at_once=True)

    def _check(
        self,
        entries: list[_Entry],
        failure: FlatViewError | None,
        outside: bool,
        *,
        at_once: bool = False,
    ) -> None:
        self._deferred = []
        earlier, self._deferred_failure = self._deferred_failure, None
        each = [self._prints_of(s, f) for s, f, _ in entries]
        prints = [combined([p[k] for p in each]) for k in range(len(self._slots))]
        agreement = Agreement(
            prints,
            lambda: [self._declared(e) for e in entries],
            self.adapter.agreement_group,
            self.adapter.device,
            self.ledger,
            peers=self.table.peers,
            failure=failure or earlier,
            raise_own=failure is not None,
            outside=outside,
        )
        if at_once or failure or earlier or not self.adapter.overlaps_agreement:
            agreement.settle()
        else:
            self._pending = agreement

    def _prints_of(self, skipped: frozenset[int], frozen: frozenset[int]) -> tuple[int, ...]:
        """Per slot, the fingerprint of one declaration, kept for recent pairs: skip
        sets repeat, and a fingerprint sorts and hashes every index in them."""
        key = (skipped, frozen)
        found = self._prints.get(key)
        if found is None:
            if len(self._prints) >= PRINTS_CACHE:
                self._prints.clear()
            found = tuple(fingerprint(skipped & slot, frozen & slot) for slot in self._slots)
            self._prints[key] = found
        return found

    def _declared(self, entry: _Entry) -> Declared:
        skipped, frozen, outside = entry
        params = self.table.params

        def names(indices: frozenset[int]) -> tuple[tuple[str, ...], ...]:
            return tuple(tuple(params[i].name for i in sorted(indices & s)) for s in self._slots)

        return Declared(names(skipped), names(frozen), outside)

    def settle(self) -> None:
        """Wait for the check in flight, if any, raising
        :class:`~flatview.errors.SkipSetMismatchError` on every rank if ranks disagree
        (:attr:`failed_outside` then says whether it was an outside-step one)."""
        agreement, self._pending = self._pending, None
        if agreement is None:
            return
        self.failed_outside = False
        try:
            agreement.settle()
        except BaseException:
            self.failed_outside = agreement.outside
            raise
