"""Communication: the gradient reductions adapters hold (``sharded``, ``replicated``, what
they share in ``reduction``, bucket cutting in ``bucketing``, tuning in ``options``), the
masked all-gather, skip-set agreement, the collectives of norms and consolidation, and
byte accounting (``ledger``)."""
