"""The planner's tests read no calibration a user cached: remat.plan would prefer its constants."""

import pytest


@pytest.fixture(autouse=True)
def _empty_calibration_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat-cache"))
