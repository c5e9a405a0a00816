"""The model as the engines read it: layer kinds, KV bytes per token, weight bytes per rank, presets."""
