"""From samples and request records to measurements: levels, the plateau, the diagnosis."""
