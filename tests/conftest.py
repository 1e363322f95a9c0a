"""Test-wide settings: calibrations go to a temporary file, never to the user's cache."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def _calibration_file(tmp_path_factory):
    import os

    path = tmp_path_factory.mktemp("calibration") / "calibration.json"
    saved = os.environ.get("SPECDEC_CALIBRATION")
    os.environ["SPECDEC_CALIBRATION"] = str(path)
    yield
    if saved is None:
        os.environ.pop("SPECDEC_CALIBRATION", None)
    else:
        os.environ["SPECDEC_CALIBRATION"] = saved
