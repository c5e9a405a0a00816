"""What the engine says while it runs: /metrics samples, its published configuration, single requests."""
