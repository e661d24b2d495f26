"""Fixtures shared by the storage tests."""

import pytest


@pytest.fixture
def roots(tmp_path):
    """Two root directories (not created: the handler creates them)."""
    return [tmp_path / "root0", tmp_path / "root1"]
