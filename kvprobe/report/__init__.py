"""What a person reads: the verdict table, the per-level table, the plot and the artifact files."""
