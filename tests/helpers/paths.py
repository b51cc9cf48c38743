"""Where the repository's parts are, for a test module in whatever folder of tests/ it is."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SRC = REPO / "src" / "bagpipe"
TEST_DATA = TESTS / "data"  # stored material (an old run dir), not generated
HELPERS = TESTS / "helpers"
