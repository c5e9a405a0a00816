"""The capacity ledger: every figure of one engine configuration, built, then rendered as text."""
