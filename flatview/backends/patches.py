"""What an adapter attaches to a wrapper, and takes back: instance attributes that shadow
a method of one object (never a class), hooks, and the wrapper methods that lend the
model (run with the views stepped aside)."""

from __future__ import annotations

LENDING_METHODS = ("state_dict", "load_state_dict", "_apply")
"""Wrapper methods that run with the views stepped aside (they read or replace the flat
parameters the wrapper registered), on every unit."""


ROOT_LENDING_METHODS = ("clip_grad_norm_",)
"""Lending methods of the root unit only. The FSDP wrappers' gradient clipping takes the
norm over ``self.parameters()``: views there would be counted besides (torch) or instead
of (fairscale: empty ones included, whose ``max()`` fails for ``norm_type=inf``) the flat
parameters the wrapper manages."""
