"""Test aids for flatview and its users (not needed in production)."""

from flatview.testing._deepspeed_cpu import deepspeed_on_cpu
from flatview.testing._fairscale_cpu import fairscale_on_cpu

__all__ = ["deepspeed_on_cpu", "fairscale_on_cpu"]
