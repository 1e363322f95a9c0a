"""The drafter protocol: the decoder calls what a drafter declares, never probes it nor writes its
attributes, and a user's object with only `propose` runs with the protocol's defaults."""

import pytest
import torch

from specdec.drafters import (
    CustomDrafter,
    Drafter,
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
    as_drafter,
)
from specdec.drafters.proposal import Proposal
from specdec.models.adapters import HFCausalLM
from specdec.tuning.costs import DraftSettings
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.sampling import SamplingConfig
from tests.tiny import build, decode, hf_greedy

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    return {
        "target": build("llama", 0, root / "target", layers=2),
        "draft": build("llama", 1, root / "draft", layers=1),
    }


class Sealed(Drafter):
    """A drafter whose attributes nobody may set: the decoder must call its methods. It records them."""

    learns = True

    def __init__(self, calls: list):
        object.__setattr__(self, "calls", calls)
        object.__setattr__(self, "ngram", NgramDrafter())

    def __setattr__(self, name, value):
        raise AssertionError(f"the decoder wrote drafter.{name}")

    def reset(self, batch):
        self.calls.append("reset")

    def configure(self, settings):
        self.calls.append(("configure", settings.width))

    def propose(self, sequences, max_lengths, warping, generator, race=None):
        self.calls.append("propose")
        return self.ngram.propose(sequences, max_lengths, warping, generator)

    def observe(self, proposal, result):
        self.calls.append("observe")


def greedy_tokens(models, drafter, n: int, k: int = 1) -> list[int]:
    """The new tokens of one greedy run of the tiny target with this drafter at a fixed k."""
    rows, _ = decode(HFCausalLM(models["target"]), drafter, [PROMPT], max_new_tokens=n, sampling=GREEDY,
                     policy=DraftLengthPolicy(k=k))  # fmt: skip
    return rows[0].new_tokens


def test_the_decoder_calls_a_drafters_methods_and_never_writes_its_attributes(models):
    calls = []
    assert greedy_tokens(models, Sealed(calls), 12, k=3) == hf_greedy(models["target"], PROMPT, 12)
    assert calls[:3] == ["reset", ("configure", 1), "propose"] and "observe" in calls


def test_a_drafter_that_declares_it_learns_nothing_is_not_told_the_rounds(models):
    class Quiet(Sealed):
        learns = False

    calls = []
    decode(
        HFCausalLM(models["target"]),
        Quiet(calls),
        [PROMPT],
        max_new_tokens=6,
        sampling=GREEDY,
        policy=DraftLengthPolicy(k=2),
    )
    assert "observe" not in calls and "propose" in calls


def test_only_a_drafter_that_can_extend_is_given_the_extension(models):
    seen = []

    class Extending(ModelDrafter):
        def plan_round(self, price):
            seen.append(price.extension)
            super().plan_round(price)

    target = models["target"]
    for stop_below, expect in (("auto", True), (None, False)):
        seen.clear()
        drafter = Extending(HFCausalLM(models["draft"]), stop_below=stop_below)
        batch, _ = decode(
            HFCausalLM(target), drafter, [PROMPT], max_new_tokens=10, sampling=GREEDY, policy=DraftLengthPolicy(k=None)
        )
        assert batch[0].new_tokens == hf_greedy(target, PROMPT, 10)
        assert any(seen) == expect


class ProposeOnly:
    """A user's drafter with nothing but propose: no reset, rollback, uses_model or max_positions."""

    def __init__(self):
        self.rounds = 0

    def propose(self, sequences, max_lengths, warping, generator):  # written before race verification
        self.rounds += 1
        return Proposal(torch.zeros(len(sequences), 1, dtype=torch.long), max_lengths.clamp(max=1), None)


def test_an_object_with_only_propose_runs_with_the_defaults(models):
    user = ProposeOnly()
    wrapped = as_drafter(user)
    assert isinstance(wrapped, CustomDrafter) and wrapped.name == "ProposeOnly"
    assert not (wrapped.uses_model or wrapped.supports_trees or wrapped.learns or wrapped.can_extend)
    assert not wrapped.can_select_rows and wrapped.max_positions is None and wrapped.adapter is None
    assert greedy_tokens(models, user, 8) == hf_greedy(models["target"], PROMPT, 8) and user.rounds > 0


def test_an_object_is_called_for_propose_alone_and_a_drafter_subclass_for_the_protocol(models):
    class Learning(ProposeOnly):
        def observe(self, proposal, result):
            raise AssertionError("not a Drafter: only its propose is called")

    learning = Learning()
    assert greedy_tokens(models, learning, 8) == hf_greedy(models["target"], PROMPT, 8) and learning.rounds > 0

    class Subclassed(Drafter):  # the same drafter, declared: its observe is called
        learns = True

        def __init__(self):
            self.seen = []

        def propose(self, sequences, max_lengths, warping, generator, race=None):
            return ProposeOnly().propose(sequences, max_lengths, warping, generator)

        def observe(self, proposal, result):
            self.seen.append(result)

    drafter = Subclassed()
    assert as_drafter(drafter) is drafter
    assert greedy_tokens(models, drafter, 8) == hf_greedy(models["target"], PROMPT, 8) and drafter.seen


def test_specdecs_drafters_are_not_wrapped_and_declare_what_they_do(models):
    model = ModelDrafter(HFCausalLM(models["draft"]))
    assert as_drafter(model) is model and model.supports_trees and model.learns and model.can_extend
    ngram = NgramDrafter()  # learns its copies' acceptance per match length, stops on its own under auto k
    assert as_drafter(ngram) is ngram and ngram.learns and ngram.can_extend
    assert not (ngram.uses_model or ngram.supports_trees)
    plain = NoDrafter()
    assert as_drafter(plain) is plain
    assert not (plain.uses_model or plain.supports_trees or plain.learns or plain.can_extend)
    with pytest.raises(ValueError, match="propose"):
        as_drafter(object())


def test_configure_sets_the_runs_width_and_costs(models):
    drafter = ModelDrafter(HFCausalLM(models["draft"]))
    drafter.configure(DraftSettings(width="auto", stop_costs=(0.5, 0.25), verify_cost=lambda w: 2.0 * w, max_width=4))
    assert drafter.width == "auto" and drafter.stop_costs == [0.5, 0.25] and drafter.max_width == 4
    assert drafter.verify_cost(3) == 6.0


def test_a_draft_past_k_must_pay_for_every_rows_column(models):
    """Under batch-measured costs, auto k's extension bar is the batch's: a draft past k widens every
    row's verify, as a copy does, so its bar is rows x a row's."""
    from specdec.tuning.costs import Costs

    seen = []

    class Extending(ModelDrafter):
        def plan_round(self, price):
            seen.append(price.extension)
            super().plan_round(price)

    def first_bar(rows: int) -> tuple:
        seen.clear()
        policy = DraftLengthPolicy(k=None, costs=Costs(0.05, ((1, 1.0), (11, 1.2))))
        decode(HFCausalLM(models["target"]), Extending(HFCausalLM(models["draft"])), [PROMPT] * rows,
               max_new_tokens=2, sampling=GREEDY, policy=policy)  # fmt: skip
        return seen[0]  # the first round: the same counts and costs, 1 row or 8

    (k, bar), (k8, bar8) = first_bar(1), first_bar(8)
    assert k8 == k and bar8 == pytest.approx(8 * bar)


class BigramTarget:
    """A TargetModel written from scratch, with no transformers model: each next-token law is a fixed
    table row of the token before. Its "cache" is how many tokens of each row it has seen."""

    name, vocab_size, embed_size, device, max_positions = "bigram", 16, 16, torch.device("cpu"), None
    supports_trees, can_select_rows, model, progress, compile_seconds, compile_mode, lean = (
        False, True, None, None, 0.0, None, None)  # fmt: skip

    def __init__(self):
        self.table = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)) * 3
        self.lengths = torch.zeros(0, dtype=torch.long)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        out = list(prompt)
        for _ in range(n):
            out.append(int(self.table[out[-1]].argmax()))
        return out[len(prompt) :]

    def reset(self, batch):
        self.lengths = torch.zeros(batch, dtype=torch.long)

    def feed(self, sequences, active, extra=None, extra_valid=None, keep_logits=1, extra_parents=None):
        rows = [list(s[int(n) :]) if on else [] for s, n, on in zip(sequences, self.lengths, active.tolist())]
        width = max(1, max(map(len, rows)))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        valid = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
        if extra is not None:
            ids, valid = torch.cat([ids, extra], 1), torch.cat([valid, extra_valid & active[:, None]], 1)
        return self.forward(ids, valid, keep_logits)

    def forward(self, ids, valid, keep_logits=1):
        self.lengths = self.lengths + valid.sum(1)
        return self.table[ids[:, -keep_logits:]]

    def keep_path(self, keep):
        raise NotImplementedError("chains only")

    def rollback(self, keep_len):
        self.lengths = torch.minimum(self.lengths, keep_len)

    def commit(self, keep_len, path=None):
        self.rollback(keep_len)

    def select_rows(self, rows):
        self.lengths = self.lengths[rows]

    def add_rows(self, count):
        self.lengths = torch.cat([self.lengths, torch.zeros(count, dtype=torch.long)])


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_a_target_model_written_from_scratch_runs_through_speculative_decoder(draft):
    import specdec

    target = BigramTarget()
    decoder = specdec.SpeculativeDecoder(target=target, drafter=draft)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7]]
    out = decoder.generate(prompts, max_new_tokens=20, temperature=0, num_draft_tokens=3)
    assert [r.token_ids for r in out] == [target.greedy(p, 20) for p in prompts]
    alone = specdec.generate(prompts[0], target=BigramTarget(), draft=draft, max_new_tokens=20, temperature=0)
    assert alone.token_ids == target.greedy(prompts[0], 20)  # the one-shot call takes it too
    if draft == "ngram":
        assert out[0].batch_metrics.drafted_tokens > 0
