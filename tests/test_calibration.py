"""Calibration: measured once per host, pair and batch size, cached in the process and on disk;
`auto` then decides from counts only, so a seed gives the same tokens whatever the clock does."""

import itertools
import json
import os
import random

import pytest

import specdec
from specdec.models.adapters import HFCausalLM
from specdec.tuning import calibration
from specdec.tuning.costs import Costs
from tests.tiny import build


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration")
    return build("qwen2", 0, root / "t", layers=2), build("qwen2", 1, root / "d", layers=1)


def test_calibration_is_measured_once_and_kept_on_disk(pair, monkeypatch):
    target, draft = HFCausalLM(pair[0], name="cal-target"), HFCausalLM(pair[1], name="cal-draft")
    calibration._memory.clear()
    costs = calibration.calibrate(target, draft, batch=2, repeats=1)
    assert costs.batch == 2 and costs.draft_step_s > 0 and [w for w, _ in costs.target_s] == list(calibration.WIDTHS)
    stored = json.loads(open(os.environ["SPECDEC_CALIBRATION"]).read())
    assert any(key.startswith("cal-target:float32") and "batch=2" in key for key in stored)
    calibration._memory.clear()  # a new process: read back from disk, not measured again
    monkeypatch.setattr(calibration, "forward_seconds", lambda *a, **k: pytest.fail("measured again"))
    assert calibration.calibrate(target, draft, batch=2) == costs


def test_a_calibration_of_other_widths_is_not_read_back(pair, monkeypatch):
    """Costs measured at one set of target widths are never served where another set is measured (a wider
    set would otherwise read back costs that stop short of it)."""
    target, draft = HFCausalLM(pair[0], name="cal-widths"), HFCausalLM(pair[1], name="cal-draft")
    calibration._memory.clear()
    calibration.calibrate(target, draft, batch=1, repeats=1)
    calibration._memory.clear()
    monkeypatch.setattr(calibration, "WIDTHS", (*calibration.WIDTHS, 13))
    costs = calibration.calibrate(target, draft, batch=1, repeats=1)
    assert [w for w, _ in costs.target_s] == list(calibration.WIDTHS)


def test_progress_is_told_when_costs_are_measured_not_when_read_back(pair):
    target, draft = HFCausalLM(pair[0], name="told-target"), HFCausalLM(pair[1], name="told-draft")
    calibration._memory.clear()
    told = []
    calibration.calibrate(target, draft, batch=1, repeats=1, progress=told.append)
    assert len(told) == 1 and "told-draft drafting for told-target at batch 1" in told[0]
    calibration.calibrate(target, draft, batch=1, progress=told.append)  # in the process
    calibration._memory.clear()
    calibration.calibrate(target, draft, batch=1, progress=told.append)  # on disk
    assert len(told) == 1


def test_the_draft_step_is_timed_through_the_drafter(pair):
    from specdec.drafters import ModelDrafter

    target, draft = HFCausalLM(pair[0], name="probe-target"), HFCausalLM(pair[1], name="probe-draft")
    drafter = ModelDrafter(draft, stop_below="auto", width="auto")
    calibration._memory.clear()
    costs = calibration.calibrate(target, draft, drafter=drafter, repeats=2)
    assert costs.draft_step_s > 0
    # timed as full chains, set through configure (no attribute written from outside); a run configures it again
    assert drafter.width == 1 and not drafter.stops and drafter.stop_below == "auto"
    assert drafter.adapter.num_slots == 0  # and its state reset
    forward_only = calibration.calibrate(target, draft, repeats=2)
    assert forward_only is not costs  # two probes, two calibrations (kept apart by their keys)


def test_a_probe_that_drafts_nothing_falls_back_to_the_draft_forward(pair):
    import torch

    from specdec.drafters import ModelDrafter
    from specdec.drafters.proposal import Proposal

    class Idle(ModelDrafter):  # e.g. a cross-tokenizer draft whose context ends inside a character
        def propose(self, sequences, max_lengths, *args, **kwargs):
            empty = torch.zeros(len(sequences), 0, dtype=torch.long)
            return Proposal(empty, torch.zeros(len(sequences), dtype=torch.long), None)

    target, draft = HFCausalLM(pair[0], name="idle-target"), HFCausalLM(pair[1], name="idle-draft")
    calibration._memory.clear()
    assert calibration.calibrate(target, draft, drafter=Idle(draft), repeats=1).draft_step_s > 0


@pytest.mark.measured_costs
def test_auto_with_a_seed_gives_the_same_tokens_under_a_jittering_clock(pair):
    target, draft = pair
    rng = random.Random(0)
    ticks = itertools.count()

    def jittering_clock():
        return next(ticks) * rng.uniform(0.001, 5.0)  # wildly uneven "time"

    outputs = set()
    for _ in range(10):
        out = specdec.generate(
            [[3, 1, 4], [1, 5, 9, 2]],
            target=target,
            draft=draft,
            max_new_tokens=24,
            num_draft_tokens="auto",
            temperature=1.0,
            top_k=0,
            seed=7,
            clock=jittering_clock,
        )
        outputs.add(tuple(tuple(r.token_ids) for r in out))
        assert out[0].calibration is not None
    assert len(outputs) == 1


@pytest.mark.measured_costs
def test_calibration_is_in_the_cli_json(tmp_path):
    from typer.testing import CliRunner

    from specdec_cli.app import app
    from tests.tiny import save_char_tokenizer

    build("llama", 0, tmp_path / "t")
    save_char_tokenizer(tmp_path / "t")
    build("llama", 1, tmp_path / "d", layers=1)
    save_char_tokenizer(tmp_path / "d")
    args = ["generate", "Hi", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-n", "6", "--json"]
    result = CliRunner().invoke(app, args)
    data = json.loads(result.stdout)
    assert data["calibration"]["cost_ratio"] > 0 and len(data["calibration"]["target_s"]) == len(calibration.WIDTHS)
    assert "measuring this host's costs" in result.stderr  # the wait is said, on stderr


def test_costs_feed_the_policy_not_the_clock(pair, monkeypatch):
    """Where the measured costs say no k pays, auto drafts nothing from the first round."""
    target, draft = pair
    dear = Costs(1.0, ((1, 1.0), (2, 2.0), (11, 11.0)))
    monkeypatch.setattr(specdec.api, "calibrate", lambda *a, **k: dear)
    out = specdec.generate([3, 1, 4], target=target, draft=draft, max_new_tokens=10, num_draft_tokens="auto")
    assert out.metrics.drafted_tokens == 0 and out.metrics.draft_forwards == 0
    assert out.token_ids == specdec.generate([3, 1, 4], target=target, max_new_tokens=10).token_ids


def _auto_dtypes(env: dict) -> list[str]:
    """parse_dtype('auto', 'cpu') in a process started with env: [verifying drafts, the target alone]."""
    import subprocess
    import sys

    code = "from specdec.models.forms import parse_dtype as p; print(p('auto', 'cpu'), p('auto', 'cpu', True))"
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_dtype_auto_on_a_simulated_avx2_host_is_float32_but_bfloat16_for_a_target_alone():
    # one row of one token per forward: bfloat16 halves the bytes streamed (1.6x float32 there, BENCHMARKS.md)
    simulated = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert _auto_dtypes(simulated) == ["torch.float32", "torch.bfloat16"]


def test_dtype_auto_is_bfloat16_where_bf16_is_native():
    import torch

    from specdec.models.forms import parse_dtype

    flags = open("/proc/cpuinfo").read()
    limited = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper().startswith("AVX2")
    native = torch_capability() == "AVX512" and (" avx512_bf16" in flags or " amx_bf16" in flags) and not limited
    assert parse_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def torch_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def test_monotone_costs_take_the_least_time_at_or_beyond_each_width():
    from specdec.tuning.costs import monotone

    # A spike at width 1 (warm-up, another process) must not make one token look dearer than five.
    assert monotone([0.27, 0.24, 0.20, 0.196, 0.198]) == [0.196, 0.196, 0.196, 0.196, 0.198]
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
