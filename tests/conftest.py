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


@pytest.fixture(autouse=True)
def _cheap_draft_costs(request, monkeypatch):
    """Tiny test models cost the same whether they have 1 or 2 layers, so measured costs would make
    `auto` draft nothing and leave its path untested. Tests get the costs of a draft 10x cheaper than
    its target with a free verify width, unless marked `measured_costs`."""
    if request.node.get_closest_marker("measured_costs"):
        return
    from specdec import api
    from specdec.tuning.costs import Costs

    costs = Costs(0.1, ((1, 1.0), (11, 1.0)))
    monkeypatch.setattr(api, "calibrate", lambda target, draft, batch, drafter=None, progress=None: costs)


@pytest.fixture
def host_reads(monkeypatch):
    """Every host read of the device made while a test runs (one entry per PendingRead): the rounds'
    reads all go through that class."""
    import specdec.verify.reads as reads_module

    reads = []
    original = reads_module.PendingRead.__init__

    def counted(self, *args, **kwargs):
        reads.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(reads_module.PendingRead, "__init__", counted)
    return reads
