"""Small embedded model checkpoints, built in code from a seed (no downloads)."""

from numaov.models.builtin.wan_tiny import TINY_WAN_CONFIG, build_tiny_wan

__all__ = ["TINY_WAN_CONFIG", "build_tiny_wan"]
