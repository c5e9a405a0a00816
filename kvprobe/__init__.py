"""kvprobe: predict an LLM engine's KV-cache admission limit and check it against the live engine."""

__version__ = "0.1.0"
