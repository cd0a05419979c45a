"""Test aids for flatview and its users (not needed in production)."""

from flatview.testing._fairscale_cpu import fairscale_on_cpu

__all__ = ["fairscale_on_cpu"]
