"""The pytest face: options, collection of expectation files, one probe per expectation, fixtures."""
