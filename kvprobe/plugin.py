"""pytest plugin entry point (registered as `pytest11: kvprobe`). Filled in by the plugin issue."""
