"""The static-cache adapter (and its compiled forwards) on tiny random models: the cache invariant
and fresh-forward equality after every round, greedy equal to transformers, rollback without copies."""

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

import specdec
from specdec.drafters import ModelDrafter
from specdec.models.adapters import HFCausalLM, capture, static
from specdec.models.adapters.static import StaticHFCausalLM
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.sampling import SamplingConfig, Warping
from tests.tiny import build, decode, hf_greedy

ARCHS = ["gpt2", "llama", "qwen2"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny models: on a shared host, intra-op threads cost more in barriers than they save.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("static-models")
    made = {}
    for arch in ARCHS:
        made[arch, "target"] = build(arch, 0, root / f"{arch}-target", layers=2, hidden=32)
        made[arch, "smaller"] = build(arch, 2, root / f"{arch}-smaller", layers=1, hidden=16)
    return made


def prompt_of(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (length,), generator=g).tolist()


def fresh_next_logits(model, sequence):
    with torch.inference_mode():
        return model(torch.tensor([sequence], device=model.device)).logits[0, -1]


def probe_of(adapter: StaticHFCausalLM) -> StaticHFCausalLM:
    """A copy whose forwards leave the adapter untouched (the slot table is written in place)."""
    probe = copy.copy(adapter)
    probe.cache = copy.deepcopy(adapter.cache)
    probe.slot_pos = adapter.slot_pos.clone()
    return probe


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_matches_fresh_forward_after_every_round(models, arch):
    target, draft = models[arch, "target"], models[arch, "smaller"]
    # A small capacity, so the runs also grow the cache once.
    target_adapter, draft_adapter = StaticHFCausalLM(target, max_length=16), StaticHFCausalLM(draft, max_length=16)
    checked = []

    def check(engine):
        committed = engine.lengths()
        assert torch.equal(target_adapter.lengths.cpu(), committed - 1)  # the documented invariant
        assert bool((draft_adapter.lengths.cpu() <= committed - 1).all())
        for adapter, model in ((target_adapter, target), (draft_adapter, draft)):
            # Every kept token has exactly one slot, below the write pointer; nothing above it is live.
            for row in range(len(engine.sequences)):
                live = adapter.slot_pos[row][adapter.slot_pos[row] >= 0]
                assert torch.equal(live.cpu(), torch.arange(int(adapter.lengths[row])))
            assert not bool((adapter.slot_pos[:, adapter.num_slots :] >= 0).any())
            assert int(adapter.cache.get_seq_length()) == adapter.num_slots
            cached = probe_of(adapter).feed(engine.sequences, torch.ones(len(engine.sequences), dtype=torch.bool))
            for row, sequence in enumerate(engine.sequences):
                assert torch.allclose(cached[row, -1], fresh_next_logits(model, sequence), atol=1e-4)
        checked.append(len(engine.sequences))

    prompts = [prompt_of(3, 1), prompt_of(11, 2), prompt_of(6, 3)]
    for sampling in (SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)):
        decode(
            target_adapter,
            ModelDrafter(draft_adapter),
            prompts,
            max_new_tokens=14,
            warping=Warping.from_sampling(sampling),
            policy=DraftLengthPolicy(k=3),
            generator=torch.Generator(target.device).manual_seed(0),
            on_round=check,
        )
    assert len(checked) >= 10
    assert target_adapter.capacity > 16 and draft_adapter.capacity > 16  # both grew past the first allocation


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_equals_transformers_greedy(models, arch, k):
    target, draft = models[arch, "target"], models[arch, "smaller"]
    for prompt_len, max_new in [(1, 33), (7, 8), (12, 33)]:
        prompt = prompt_of(prompt_len, seed=prompt_len)
        expected = hf_greedy(target, prompt, max_new)
        out = specdec.generate(
            prompt,
            target=StaticHFCausalLM(target, max_length=64),
            draft=StaticHFCausalLM(draft, max_length=64),
            max_new_tokens=max_new,
            num_draft_tokens=k,
        )
        assert out.token_ids == expected, (prompt_len, max_new)
        alone = specdec.generate(prompt, target=StaticHFCausalLM(target), draft="ngram", max_new_tokens=max_new)
        assert alone.token_ids == expected


def test_batch_equals_dynamic_adapter_and_solo_runs(models):
    target, draft = models["llama", "target"], models["llama", "smaller"]
    prompts = [prompt_of(2, 5), prompt_of(15, 6), prompt_of(8, 7)]

    def run(adapter_class, batch_prompts):
        out, _ = decode(
            adapter_class(target),
            ModelDrafter(adapter_class(draft)),
            batch_prompts,
            max_new_tokens=25,
            warping=Warping.from_sampling(SamplingConfig(temperature=0)),
            policy=DraftLengthPolicy(k=3),
        )
        return [out[row].new_tokens for row in range(len(batch_prompts))]

    static = run(StaticHFCausalLM, prompts)
    assert static == run(HFCausalLM, prompts)
    for prompt, row in zip(prompts, static):
        assert row == run(StaticHFCausalLM, [prompt])[0] == hf_greedy(target, prompt, 25)


def test_eager_attention_batch_equals_transformers_greedy(models):
    # The eager attention path builds an additive float mask from the same 2D slot mask.
    target, draft = (
        AutoModelForCausalLM.from_pretrained(models["gpt2", role].config._name_or_path, attn_implementation="eager")
        for role in ("target", "smaller")
    )
    device = models["gpt2", "target"].device
    prompts = [prompt_of(2, 5), prompt_of(15, 6), prompt_of(8, 7)]
    out, _ = decode(
        StaticHFCausalLM(target.to(device).eval(), max_length=16),
        ModelDrafter(StaticHFCausalLM(draft.to(device).eval(), max_length=16)),
        prompts,
        max_new_tokens=20,
        warping=Warping.from_sampling(SamplingConfig(temperature=0)),
        policy=DraftLengthPolicy(k=3),
    )
    for row, prompt in enumerate(prompts):
        assert out[row].new_tokens == hf_greedy(target, prompt, 20)


def test_rollback_moves_the_pointer_without_copies(models):
    adapter = StaticHFCausalLM(models["qwen2", "target"], max_length=64)
    adapter.reset(2)
    keys = adapter.cache.layers
    adapter.feed([[1, 2, 3], [4, 5]], torch.tensor([True, True]))
    ids = torch.tensor([[7, 8, 9], [0, 6, 7]], device=adapter.device)
    adapter.forward(ids, torch.tensor([[True, True, True], [False, True, True]], device=adapter.device))
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in keys]
    assert adapter.num_slots == 6 and adapter.lengths.tolist() == [6, 4]
    adapter.rollback(torch.tensor([4, 2]))  # row 0 keeps slot 3, row 1 drops both new tokens
    assert adapter.num_slots == 4 and adapter.slot_pos[:, :4].tolist() == [[0, 1, 2, 3], [-1, 0, 1, -1]]
    adapter.rollback(torch.tensor([2, 1]))  # row 1's last kept token is in slot 1
    assert adapter.num_slots == 2 and adapter.slot_pos[:, :2].tolist() == [[0, 1], [-1, 0]]
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in adapter.cache.layers] == storage
    adapter.reset(2)  # same batch: the same tensors are reused
    assert adapter.num_slots == 0 and int(adapter.cache.get_seq_length()) == 0
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in adapter.cache.layers] == storage


def test_context_limit_is_checked(models):
    adapter = StaticHFCausalLM(models["gpt2", "target"], max_length=600)
    with pytest.raises(ValueError, match="context"):
        adapter.feed([list(range(90)) * 6], torch.tensor([True]))


def test_sliding_window_models_are_refused(tmp_path):
    model = build("qwen2", 0, tmp_path / "q")
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    with pytest.raises(ValueError, match="full-attention"):
        StaticHFCausalLM(model)


@pytest.mark.slow  # ~10 s with inductor's on-disk cache warm, ~45 s cold on 2 shared cores
def test_compiled_greedy_equals_transformers_greedy(models, monkeypatch):
    # One padded width per model keeps the compile time to a few seconds: the target gets two
    # graphs (windows of 32 and 64 slots), the draft one (its whole capacity).
    monkeypatch.setattr(static, "MIN_WINDOW", 32)
    target, draft = models["llama", "target"], models["llama", "smaller"]
    target_adapter = StaticHFCausalLM(target, max_length=64, compile=True, compile_widths=[3])
    draft_adapter = StaticHFCausalLM(draft, max_length=64, compile=True, compile_widths=[2], compile_windows=False)
    accepted, rejected = 0, 0
    for prompt_len, max_new in [(7, 30), (3, 20)]:
        prompt = prompt_of(prompt_len, seed=prompt_len)
        expected = hf_greedy(target, prompt, max_new)
        for drafter in (draft_adapter, "ngram"):  # the random draft is always rejected, n-grams partly kept
            out = specdec.generate(
                prompt, target=target_adapter, draft=drafter, max_new_tokens=max_new, num_draft_tokens=2
            )
            assert out.token_ids == expected
            accepted += out.metrics.accepted_tokens
            rejected += out.metrics.drafted_tokens - out.metrics.accepted_tokens
    assert accepted > 0 and rejected > 0
    assert target_adapter.compile_seconds > 0 and draft_adapter.compile_seconds > 0
    assert target_adapter.captures.shapes == {(1, 3, 32), (1, 3, 64)}
    assert draft_adapter.captures.shapes == {(1, 2, 64)}


@pytest.mark.slow  # ~60 s cold on 2 shared cores: inductor compiles the forward (static, then dynamic shapes)
def test_inductor_graphs_greedy_equals_transformers_greedy(models, monkeypatch):
    # compile="inductor-graphs": the compiled model's forward over the graph buffers and additive mask
    # (on CUDA it is captured; here it runs as is): the target alone (read ahead) and with n-grams.
    monkeypatch.setattr(static, "MIN_WINDOW", 32)
    target = models["llama", "target"]
    adapter = StaticHFCausalLM(target, max_length=64, compile="inductor-graphs", compile_widths=[1, 3])
    for prompt_len, max_new in [(7, 30), (3, 20)]:
        prompt = prompt_of(prompt_len, seed=prompt_len)
        expected = hf_greedy(target, prompt, max_new)
        for drafter in (None, "ngram"):
            out = specdec.generate(prompt, target=adapter, draft=drafter, max_new_tokens=max_new, num_draft_tokens=2)
            assert out.token_ids == expected, (prompt_len, drafter)
    assert {shape[1:] for shape in adapter.captures.graphs} == {(1, 32), (3, 32), (1, 64), (3, 64)}
    assert adapter.compile_mode == "inductor-graphs" and adapter.captures.compiled is not None


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_buffers_greedy_equals_transformers_greedy(models, arch, monkeypatch):
    # compile="graphs" on CPU runs the captured path's static buffers and additive mask eagerly
    # (CUDA captures the same calls): padded widths, windows, solo and a ragged batch.
    monkeypatch.setattr(static, "MIN_WINDOW", 16)
    target, draft = models[arch, "target"], models[arch, "smaller"]
    target_adapter = StaticHFCausalLM(target, max_length=48, compile="graphs", compile_widths=[1, 3, 5])
    draft_adapter = StaticHFCausalLM(draft, max_length=48, compile="graphs", compile_widths=[2])
    prompts = [prompt_of(2, 5), prompt_of(15, 6), prompt_of(8, 7)]
    for prompt in prompts:
        expected = hf_greedy(target, prompt, 25)
        for drafter, k in ((draft_adapter, 2), (draft_adapter, 4), ("ngram", 3)):
            out = specdec.generate(prompt, target=target_adapter, draft=drafter, max_new_tokens=25, num_draft_tokens=k)
            assert out.token_ids == expected, (arch, len(prompt), k)
    assert {shape[1] for shape in target_adapter.captures.graphs} == {1, 3, 5}
    assert {shape[2] for shape in target_adapter.captures.graphs} >= {16, 32}  # windows grew with the length
    assert draft_adapter.captures.graphs and target_adapter.compile_mode == "graphs"
    out, _ = decode(
        target_adapter,
        ModelDrafter(draft_adapter),
        prompts,
        max_new_tokens=25,
        warping=Warping.from_sampling(SamplingConfig(temperature=0)),
        policy=DraftLengthPolicy(k=3),
    )
    assert [out[row].new_tokens for row in range(3)] == [hf_greedy(target, p, 25) for p in prompts]
    assert {shape[0] for shape in target_adapter.captures.graphs} == {3}  # a new batch size: a new cache, new graphs


def test_warm_up_is_reported_in_the_metrics(models):
    target = models["llama", "target"]
    decoder = specdec.SpeculativeDecoder(StaticHFCausalLM(target, max_length=64, compile="graphs"), "ngram")
    first = decoder.generate(prompt_of(9), max_new_tokens=12, num_draft_tokens=3, temperature=0)
    again = decoder.generate(prompt_of(9), max_new_tokens=12, num_draft_tokens=3, temperature=0)
    assert 0 < first.metrics.compile_time_s < first.metrics.wall_time_s
    assert again.metrics.compile_time_s == 0  # the same shapes: replayed, not captured again
    assert again.token_ids == first.token_ids


def test_each_new_shape_is_announced_once_through_on_status(models):
    target = models["llama", "target"]
    decoder = specdec.SpeculativeDecoder(StaticHFCausalLM(target, max_length=64, compile="graphs"), "ngram")
    told = []
    decoder.on_status = told.append
    decoder.generate(prompt_of(9), max_new_tokens=12, num_draft_tokens=3, temperature=0)
    shapes = decoder.target.captures.graphs
    assert len(told) == len(shapes) > 0 and all("capturing a CUDA graph" in line for line in told)
    assert {f"1 x {width} tokens over {window} cache slots" for _, width, window in shapes} == {
        line.split(": capturing a CUDA graph for ")[1].split(" (once")[0] for line in told
    }
    decoder.generate(prompt_of(9), max_new_tokens=12, num_draft_tokens=3, temperature=0)
    assert len(told) == len(shapes)  # replayed: nothing new to say


def test_graphs_refuse_attention_without_an_additive_mask(models):
    model = copy.deepcopy(models["llama", "target"])
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="sdpa or eager"):
        StaticHFCausalLM(model, compile="graphs")


def test_compile_modes():
    assert capture.compile_mode(True, torch.device("cpu")) == "inductor"
    assert capture.compile_mode(True, torch.device("cuda")) == "graphs"
    assert capture.compile_mode(False, torch.device("cuda")) is None
    assert capture.compile_mode("graphs", torch.device("cpu")) == "graphs"
    with pytest.raises(ValueError, match="compile must be"):
        capture.compile_mode("max-autotune", torch.device("cpu"))


def test_from_pretrained_builds_static_adapters(tmp_path):
    from tests.tiny import build as build_model

    target = build_model("llama", 0, tmp_path / "t")
    build_model("llama", 1, tmp_path / "d", layers=1)
    decoder = specdec.SpeculativeDecoder.from_pretrained(
        str(tmp_path / "t"), str(tmp_path / "d"), dtype="float32", device="cpu", cache="static"
    )
    assert isinstance(decoder.target, StaticHFCausalLM) and isinstance(decoder.drafter.adapter, StaticHFCausalLM)
    out = decoder.generate([3, 1, 4], max_new_tokens=12, temperature=0, num_draft_tokens=3)
    assert out.token_ids == hf_greedy(target, [3, 1, 4], 12)
    with pytest.raises(ValueError, match="cache"):
        specdec.SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), device="cpu", cache="paged")
    with pytest.raises(ValueError, match="needs CUDA"):  # issue 32: refused on the CPU, in one line
        specdec.SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), device="cpu", cache="static", compile=True)
    with pytest.raises(ValueError, match="compile"):
        specdec.SpeculativeDecoder.from_pretrained(str(tmp_path / "t"), device="cpu", compile="yes")


def test_auto_cache_captures_on_cuda_only(tmp_path, monkeypatch):
    # The defaults (cache="auto", compile="auto"): the dynamic cache on the CPU; on CUDA the static cache with
    # CUDA graphs (here _on_cuda is faked: "graphs" runs its static buffers eagerly on the CPU), and the
    # dynamic cache for a model the graphs cannot hold (sliding-window layers).
    from tests.tiny import build as build_model

    target = build_model("llama", 0, tmp_path / "t")
    build_model("llama", 1, tmp_path / "d", layers=1)
    paths = str(tmp_path / "t"), str(tmp_path / "d")
    decoder = specdec.SpeculativeDecoder.from_pretrained(*paths, dtype="float32", device="cpu")
    assert type(decoder.target) is HFCausalLM and type(decoder.drafter.adapter) is HFCausalLM
    monkeypatch.setattr(specdec.loading, "_on_cuda", lambda model: True)
    decoder = specdec.SpeculativeDecoder.from_pretrained(*paths, dtype="float32", device="cpu")
    for adapter in (decoder.target, decoder.drafter.adapter):
        assert isinstance(adapter, StaticHFCausalLM) and adapter.compile_mode == "graphs"
    assert decoder.drafter.stop_below == "auto"  # the device is the CPU: only CUDA turns the stop off
    out = decoder.generate([3, 1, 4], max_new_tokens=12, temperature=0, num_draft_tokens=3)
    assert out.token_ids == hf_greedy(target, [3, 1, 4], 12)
    sliding = build_model("qwen2", 0, tmp_path / "q")
    sliding.config.layer_types = ["sliding_attention"] * sliding.config.num_hidden_layers
    sliding.config.sliding_window = 16
    assert type(specdec.loading._wrap(sliding, "q", "auto", "auto")) is HFCausalLM
    with pytest.raises(ValueError, match="full-attention"):  # asked for explicitly: the reason, not a fallback
        specdec.loading._wrap(sliding, "q", "auto", True)
    flash = copy.deepcopy(target)  # graphs need an additive mask: flash attention takes none
    flash.config._attn_implementation = "flash_attention_2"
    assert specdec.loading._wrap(flash, "f", "static", "auto").compile_mode is None  # cache="static": kept, uncompiled
    assert type(specdec.loading._wrap(flash, "f", "auto", "auto")) is HFCausalLM
    built = specdec.SpeculativeDecoder(target, build_model("llama", 1, tmp_path / "d2", layers=1))
    assert built.target.compile_mode == "graphs" and built.drafter.adapter.eager_on_failure  # loaded models too


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_fixed_stop_keeps_greedy_equal_to_transformers(models, cache):
    # A fixed stop reads each draft's confidence on the host and cuts the chain there: one draft forward
    # per draft, and the output is still the target's.
    target, draft = models["llama", "target"], models["llama", "smaller"]
    make = HFCausalLM if cache == "dynamic" else StaticHFCausalLM
    prompt = prompt_of(9, seed=3)
    out, metrics = decode(
        make(target),
        ModelDrafter(make(draft), stop_below=0.5),
        [prompt],
        max_new_tokens=30,
        warping=Warping.from_sampling(SamplingConfig(temperature=0)),
        policy=DraftLengthPolicy(k=4),
    )
    assert out[0].new_tokens == hf_greedy(target, prompt, 30)
    assert metrics.draft_forwards == metrics.drafted_tokens < 4 * metrics.rounds  # some chains were cut


def test_a_forward_that_cannot_be_captured_runs_uncompiled_under_compile_auto(models, monkeypatch):
    # compile="auto" (eager_on_failure): the first capture fails, the adapter says so once and runs
    # uncompiled from then on, with greedy output still equal to transformers'; asked for explicitly, it raises.
    target = models["llama", "target"]

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(capture, "CapturedForward", refuse)
    prompt = prompt_of(7, seed=4)
    adapter = StaticHFCausalLM(target, max_length=64, compile="graphs")
    adapter.eager_on_failure, said = True, []
    out = specdec.generate(
        prompt, target=adapter, draft="ngram", max_new_tokens=20, num_draft_tokens=3, progress=said.append
    )
    assert out.token_ids == hf_greedy(target, prompt, 20)
    assert adapter.compile_mode is None and len([s for s in said if "capture failed" in s]) == 1
    strict = StaticHFCausalLM(target, max_length=64, compile="graphs")
    with pytest.raises(RuntimeError, match="capturing"):
        specdec.generate(prompt, target=strict, draft="ngram", max_new_tokens=20, num_draft_tokens=3)


def test_inductor_modes_keep_their_compile_cache_beside_specdecs(models, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    StaticHFCausalLM(models["llama", "target"], max_length=32, compile="graphs")  # no inductor: nothing set
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    StaticHFCausalLM(models["llama", "target"], max_length=32, compile="inductor-graphs")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo sets
    StaticHFCausalLM(models["llama", "target"], max_length=32, compile="inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice stays
    StaticHFCausalLM(models["llama", "target"], max_length=32, compile="inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_warm_up_and_capture_helpers(monkeypatch):
    # The CUDA-only helpers' control flow, with torch.cuda's stream and graph calls faked on the CPU: two
    # warm-up runs, each cropped back; one run inside the capture, whose output is returned; the garbage
    # collector off during the capture and then as the application had it.
    import contextlib
    import gc

    class Stream:
        def __init__(self, *args):
            pass

        def wait_stream(self, other):
            pass

    events = []
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):
        events.append("capture begins")
        yield
        events.append("capture ends")

    monkeypatch.setattr(torch.cuda, "graph", graph)

    class Cache:
        def crop(self, n):
            events.append(f"crop {n}")

    def run():
        events.append(f"run, collecting={gc.isenabled()}")
        return len(events)  # 1 for the first run, 3 for the second (after a crop)

    assert capture.warm_up(run, Cache(), 3, "cuda") == 3  # the last run's output
    assert events == ["run, collecting=True", "crop -3", "run, collecting=True", "crop -3"]
    events.clear()
    for collecting in (True, False):
        (gc.enable if collecting else gc.disable)()
        try:
            before = len(events)
            assert capture.capture(object(), run, None, "cuda") == before + 2  # run's output, from inside
            assert gc.isenabled() == collecting
        finally:
            gc.enable()
    assert events == ["capture begins", "run, collecting=False", "capture ends"] * 2
