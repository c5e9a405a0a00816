"""Run every `bench/bench_*.py` module's `main()` in turn and print their reports."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def main() -> int:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                   if m.name.startswith("bench_"))
    failed = 0
    for name in names:
        print(f"== {name}")
        try:
            importlib.import_module(f"bench.{name}").main()
        except Exception as err:  # one broken bench must not hide the others' figures
            failed += 1
            print(f"   FAILED: {type(err).__name__}: {err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
