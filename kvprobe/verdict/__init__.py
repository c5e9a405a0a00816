"""Checks: the prediction, the engine's own report and the measurement side by side, judged."""
