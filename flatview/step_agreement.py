"""The skip-set agreement check of the iteration in flight: :class:`SkipAgreement`.

With ``check_skip_agreement`` on, every checked step, and every iteration outside any
step (as one skipping nothing), starts one tiny all-gather of a fingerprint of its skip
set and frozen parameters (:mod:`flatview.comm.agreement`), on the adapter's
``agreement_group`` (every rank of the run, replicas included). Where the adapter allows
(``overlaps_agreement``) it runs alongside the forward and is settled before the first
collective the skip set decides; otherwise it is settled at once.
"""

from __future__ import annotations

from flatview.backends.base import Adapter
from flatview.comm.agreement import Agreement, fingerprint
from flatview.comm.ledger import Ledger
from flatview.errors import FlatViewError
from flatview.table import ParamTable

PRINTS_CACHE = 256
"""Fingerprints kept (skip sets may vary every step)."""


class SkipAgreement:
    """The check in flight, if any (see the module docstring)."""

    def __init__(self, table: ParamTable, adapter: Adapter, ledger: Ledger) -> None:
        self.table = table
        self.adapter = adapter
        self.ledger = ledger
        self._pending: Agreement | None = None
        # Fingerprints of recent (skip set, frozen) pairs: skip sets repeat, and a
        # fingerprint sorts and hashes every index in them.
        self._prints: dict[tuple[frozenset[int], frozenset[int]], int] = {}
        self.failed_outside = False
        """The last :meth:`settle` raised for an iteration outside any step."""

    def start(
        self,
        skipped: frozenset[int],
        *,
        failure: FlatViewError | None = None,
        outside: bool = False,
    ) -> None:
        """Start the check of a step skipping ``skipped`` (``failure``: this rank's own
        error, sent in place of its fingerprint), or of an iteration ``outside`` any step."""
        params = self.table.params
        frozen = self.table.frozen()
        if outside:
            agreement = Agreement(
                self._fingerprint(frozenset(), frozen),
                list,
                self.adapter.agreement_group,
                self.adapter.device,
                self.ledger,
                frozen=lambda: [params[i].name for i in sorted(frozen)],
                outside=True,
            )
        else:
            agreement = Agreement(
                self._fingerprint(skipped, frozen),
                lambda: [params[i].name for i in sorted(skipped)],
                self.adapter.agreement_group,
                self.adapter.device,
                self.ledger,
                frozen=lambda: [params[i].name for i in sorted(frozen)],
                failure=failure,
            )
        if failure is not None or not self.adapter.overlaps_agreement:
            agreement.settle()
        else:
            self._pending = agreement

    def _fingerprint(self, skipped: frozenset[int], frozen: frozenset[int]) -> int:
        key = (skipped, frozen)
        found = self._prints.get(key)
        if found is None:
            if len(self._prints) >= PRINTS_CACHE:
                self._prints.clear()
            found = self._prints[key] = fingerprint(skipped, frozen)
        return found

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
