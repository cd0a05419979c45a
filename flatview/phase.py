"""The lifecycle phases of a wrapped model (:class:`Phase`), and nothing else.

A leaf module: the adapter protocol (:mod:`flatview.backends.base`) and the runtime
(:mod:`flatview.runtime`) both name the phases, so they live below both.

Phases
------
``IDLE``
    Between passes. Views are registered on the original submodules; flat
    parameters are hidden from their owners.
``COMPUTING``
    A forward (and its backward) is in flight. Views stepped aside: the wrapper sets
    its own tensors under the original names. Entered at the first unit forward of an
    iteration, left when the backward ends (or at once after a forward without grad).
``LENT``
    A wrapper operation that rebuilds module attributes runs (``state_dict``,
    ``summon_full_params``, ``load_state_dict``, ``.to()``): views stepped aside.
``DETACHED``
    After :meth:`flatview.FlatView.unwrap`: the model is bare FSDP again.

Transitions (all made by :class:`flatview.runtime.Runtime`)::

    IDLE --begin_compute--> COMPUTING --end_backward / end_forward_only--> IDLE
    IDLE --lend--> LENT --(operation done)--> IDLE
    IDLE --unwrap--> DETACHED
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the wrapped model is in its lifecycle (see the module docstring)."""

    IDLE = "idle"
    COMPUTING = "computing"
    LENT = "lent"
    DETACHED = "detached"
