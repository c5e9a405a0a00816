"""Running kvprobe's two faces against the SGLang shadow, and the figures their results hold."""

from __future__ import annotations

import json

from .conftest import EXPECTATIONS, shipped


def level_figures(doc: dict) -> str:
    return "  ".join(f"N={lv['users']}: running {lv['running_mean']:.2f} waiting {lv['waiting_mean']:.2f} "
                     f"usage {lv['usage_mean']:.2f}" for lv in doc["levels"])


def check_figures(doc: dict) -> str:
    return "; ".join(f"{c['name']} {c.get('status') or ('PASS' if c['passed'] else 'FAIL')} "
                     f"(ledger {c.get('predicted')}, engine {c.get('reported')}, measured {c.get('measured')})"
                     for c in doc["checks"])


def run_pytest_kvprobe(pytester, server, names: list[str], art) -> tuple[object, dict]:
    """`pytest --kvprobe expectations/shadow-sglang.yaml::NAME[check] ... --kvprobe-url URL` in a
    subprocess: one item per check of each named expectation, all attached to `server`."""
    items = [f"{EXPECTATIONS}::{n}[{check}]" for n in names for check in shipped(n).checks]
    result = pytester.runpytest_subprocess(
        "--kvprobe", *items, "--kvprobe-url", server.url, "--kvprobe-artifacts", str(art),
        "-p", "no:cacheprovider", "-rA", "-o", "timeout=900", timeout=900)
    docs = {n: json.loads((art / n / "result.json").read_text()) for n in names}
    return result, docs


def report(figures, label: str, name: str, doc: dict) -> None:
    figures(f"{name} ({label}): {level_figures(doc)}")
    figures(f"{name} checks: {check_figures(doc)}")
