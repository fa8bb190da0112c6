"""Test helpers shared across folders (fakes, fixtures, compile settings); no tests here."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"  # pinned fixtures (parameter trees, old checkpoints and states)
