"""Fixtures of the hardening tests: the fast `tiny` profile of tests/probe, and the process groups a
probe starts, captured so a test can prove by group id that none of them is left."""

from __future__ import annotations

from tests.probe.conftest import (  # noqa: F401 — re-exported fixtures and helpers
    Groups,
    expectation,
    group_alive,
    groups,
    tiny_profile,
    wait_group_gone,
)
