"""The n-gram drafter's own stop (auto k): what it drafts of a match, and what it learns from a round."""

from types import SimpleNamespace

import torch

from specdec.bench.ngram import GOAL, verdict
from specdec.drafters import NgramDrafter
from specdec.tuning.costs import DraftSettings, RoundPrice

STEEP = DraftSettings(verify_cost=lambda width: 1.0 if width == 1 else 1.4 + 0.02 * (width - 2))  # float32 CPU
FLAT = DraftSettings(verify_cost=lambda width: 1.0)  # a wide verify as dear as a narrow one (a GPU)


def drafter(settings: DraftSettings, auto: bool = True) -> NgramDrafter:
    ngram = NgramDrafter()
    ngram.reset(1)
    ngram.configure(settings)
    ngram.plan_round(RoundPrice((4, 1.0) if auto else None))
    return ngram


def drafted(ngram: NgramDrafter, sequence: list[int], k: int = 10) -> list[int]:
    proposal = ngram.propose([sequence], torch.tensor([k]), None, None)
    return proposal.tokens[0, : int(proposal.lengths[0])].tolist()


ONE_TOKEN_MATCH = [7, 1, 2, 3, 4, 5, 9, 7]  # the last token, 7, seen once before: a 1-gram match
LONG_MATCH = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # a 3-gram match


def test_a_one_token_match_is_not_worth_a_dear_verify_but_a_long_match_is():
    ngram = drafter(STEEP)
    assert drafted(ngram, ONE_TOKEN_MATCH) == []
    assert drafted(ngram, LONG_MATCH) == [4, 5, 6, 1, 2, 3]


def test_where_a_wide_verify_costs_no_more_every_match_is_drafted():
    assert drafted(drafter(FLAT), ONE_TOKEN_MATCH) == [1, 2, 3, 4, 5, 9, 7]


def test_a_fixed_k_drafts_the_match_up_to_k_as_before():
    assert drafted(drafter(STEEP, auto=False), ONE_TOKEN_MATCH, k=3) == [1, 2, 3]


def round_result(emitted: list[int], accepted: int):
    return SimpleNamespace(num_accepted=torch.tensor([accepted]), tokens=torch.tensor([emitted]))


def test_a_match_not_drafted_still_learns_its_first_token_from_the_emitted_one():
    ngram = drafter(STEEP)
    lengths = []
    for _ in range(20):  # the target keeps emitting what the 1-gram match would have drafted
        proposal = ngram.propose([ONE_TOKEN_MATCH], torch.tensor([10]), None, None)
        n = int(proposal.lengths[0])
        lengths.append(n)
        ngram.observe(proposal, round_result(ONE_TOKEN_MATCH[1:][:n] + [0] if n else [1], n))
    assert lengths[0] == 0 and lengths[-1] > 0  # learned from rounds it did not draft, then it pays
    assert ngram.first.rate(0) > 0.8


def test_drafted_copies_teach_first_and_continuation_rates():
    ngram = drafter(FLAT)
    proposal = ngram.propose([LONG_MATCH], torch.tensor([6]), None, None)
    ngram.observe(proposal, round_result([4, 5, 0], 2))  # two accepted, the third rejected
    bin_ = 2  # a 3-token match
    assert ngram.first.successes[bin_] == 1 and ngram.first.trials[bin_] == 1
    assert ngram.continuation.successes[bin_] == 1 and ngram.continuation.trials[bin_] == 2


def test_the_guard_passes_above_the_goal_and_fails_below_transformers():
    summary = {"hf_prompt_lookup": {"tokens_per_second": 20.0}, "specdec_ngram": {"tokens_per_second": 23.0}}
    ratio, line, code = verdict(summary)
    assert ratio == 1.15 and code == 0 and f"{GOAL:.2f}x" in line and "FAIL" not in line
    summary["specdec_ngram"]["tokens_per_second"] = 21.0
    assert verdict(summary)[2] == 0 and "below the goal" in verdict(summary)[1]
    summary["specdec_ngram"]["tokens_per_second"] = 19.0
    ratio, line, code = verdict(summary)
    assert code == 1 and line.startswith("FAIL")
