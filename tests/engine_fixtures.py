"""Where the engine-produced fixtures live: `/metrics` text, start-up lines and error bodies that vLLM 0.33.0's and
SGLang 0.5.23's own code printed. They are vendored in tests/data/engine_fixtures (its README gives each file's
provenance) so that a clone needs nothing outside the repository."""
from pathlib import Path

FIXTURES = Path(__file__).parent / "data" / "engine_fixtures"


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()
