"""Host syncs per round on a GPU (SPECDEC_TEST_DEVICE=cuda; skipped elsewhere).

A round reads the device once: the verify result the host commits, with the target's finiteness
flag in the same copy. Lengths, slots and masks are host bookkeeping, sent to the device as queued
copies. A drafter whose stop reads each draft's confidence adds one read per draft step; without
the stop, the drafts are read once per round. Counted with torch.cuda.set_sync_debug_mode, which
reports every synchronising call torch makes (device-to-host copies, item(), blocking copies), and
count_host_syncs adds every wait on a CUDA event (the reads themselves, which torch does not report)."""

import pytest
import torch

from specdec.bench.main import count_host_syncs
from specdec.drafters import ModelDrafter, NoDrafter
from specdec.models.adapters import HFCausalLM
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.sampling import SamplingConfig
from tests.tiny import DEVICE, build, decode

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA host syncs (SPECDEC_TEST_DEVICE=cuda)")

K = 4
PROMPT = [5, 17, 3, 44, 8, 61, 2, 9]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync-models")
    return build("llama", 0, root / "target", layers=2, hidden=32), build("llama", 1, root / "draft", layers=1)


def adapter(model, cache: str):
    if cache == "dynamic":
        return HFCausalLM(model)
    return StaticHFCausalLM(model, max_length=128, compile="graphs" if cache == "graphs" else False)


@cuda_only
@pytest.mark.parametrize("cache", ["dynamic", "static", "graphs"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("drafter", ["none", "draft", "draft-with-stop"])
def test_host_syncs_per_round(pair, cache, temperature, drafter):
    target_model, draft_model = pair
    target = adapter(target_model, cache)
    if drafter == "none":
        draft, per_round = NoDrafter(), 1
    else:
        stop = 0.3 if drafter == "draft-with-stop" else None  # a fixed stop: "auto" is off on CUDA
        draft = ModelDrafter(adapter(draft_model, cache), stop_below=stop)
        per_round = 1 + (K if stop else 1)  # the verify read, then the drafts: per step with the stop, else once

    def run():
        generator = torch.Generator(DEVICE).manual_seed(0)
        return decode(
            target,
            draft,
            [PROMPT],
            max_new_tokens=40,
            sampling=SamplingConfig(temperature=temperature),
            policy=DraftLengthPolicy(k=K),
            generator=generator if temperature else None,
        )

    run()  # capture graphs and warm up first: capture is not a round
    (_, metrics), sites = count_host_syncs(run)
    print(cache, temperature, drafter, metrics.rounds, "rounds:", dict(sites))
    assert metrics.rounds > 1
    syncs = sum(sites.values())
    assert metrics.rounds <= syncs <= per_round * metrics.rounds + 2, (metrics.rounds, dict(sites))  # + set-up


@pytest.mark.parametrize("cache", ["dynamic", "graphs"])
@pytest.mark.parametrize("drafter", ["none", "draft", "draft-with-stop"])
def test_each_round_reads_the_device_once_on_any_device(pair, host_reads, cache, drafter):
    # The structure behind the CUDA count, checked wherever the tests run: every read of the device goes
    # through PendingRead; a round makes one (the verify result with every pending check), plus one per draft
    # step when a stop reads the drafts; the adapters' bookkeeping lives on the CPU.
    import specdec.drafters as drafters_module
    import specdec.verify.reads as reads_module

    reads = host_reads
    target_model, draft_model = pair
    target = adapter(target_model, cache)
    stop = 0.3 if drafter == "draft-with-stop" else None
    draft = NoDrafter() if drafter == "none" else ModelDrafter(adapter(draft_model, cache), stop_below=stop)
    _, metrics = decode(
        target,
        draft,
        [PROMPT],
        max_new_tokens=30,
        sampling=SamplingConfig(temperature=0),
        policy=DraftLengthPolicy(k=K),
    )
    if drafter == "draft-with-stop":
        assert metrics.rounds < len(reads) <= metrics.rounds + metrics.draft_forwards
    else:
        assert len(reads) == metrics.rounds
    assert drafters_module.read_checked is reads_module.read_checked  # the drafter reads through PendingRead
    for model in (target, getattr(draft, "adapter", None)):
        if model is not None:
            assert model.lengths.device.type == "cpu" and model.slot_pos.device.type == "cpu"
