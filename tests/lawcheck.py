"""Statistical checks shared by the tests: observed counts against an exact law.

Words:
- law: exact probabilities of each bin (float64).
- sigma distance of a bin: the signed root of the binomial deviance,
  sqrt(2 n KL(observed frequency || law)). For bins with many expected draws it
  equals the usual (count - n p) / sqrt(n p (1 - p)); for bins with tiny mass it
  stays honest where that z-score is not (one draw in a bin of mass 1e-6 out of
  6,000 rows is a 2.5-sigma event, not a 13-sigma one).
- outcome: the tokens one generated row emitted, as a tuple (shorter than the
  budget when it ended at EOS).
- the reference law: what transformers' `generate(do_sample=True, ...)` samples
  from, built here from transformers' own warpers in generate's order
  (temperature, top-k, top-p), independently of specdec.verify.sampling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def logits_to_probs(logits: torch.Tensor, config) -> torch.Tensor:
    """The engine's warped float32 probabilities for a SamplingConfig: logits [..., vocab] -> [..., vocab].
    Greedy configs give the one-hot law of the argmax (a point mass), which is what a greedy drafter
    samples from."""
    from specdec.verify.sampling import Warping

    warping = Warping.from_sampling(config)
    flat = logits.reshape(1, -1, logits.shape[-1])
    return warping.probs(warping.scores(flat)).reshape(logits.shape)


END = "end"  # the marginal bin of a position the row never reached (it ended at EOS before)


def sigma_distances(counts: torch.Tensor, law: torch.Tensor, n: int) -> torch.Tensor:
    """Per-bin signed root deviance of `counts` (n draws) against `law`; bins of mass 0 give 0 here."""
    counts, law = counts.double(), law.double()
    rest = n - counts
    deviance = 2 * (
        torch.special.xlogy(counts, counts / (n * law).clamp_min(1e-300))
        + torch.special.xlogy(rest, rest / (n * (1 - law)).clamp_min(1e-300))
    )
    return torch.sign(counts - n * law) * deviance.clamp_min(0).sqrt()


def bin_violations(
    counts: torch.Tensor, law: torch.Tensor, n: int, sigmas: float = 6.0, labels: Sequence | None = None
) -> list[str]:
    """Bins whose count is more than `sigmas` binomial standard deviations from n * law,
    plus any count in a zero-probability bin. Empty list: consistent with the law.
    `labels` names the bins in the messages (default: their index)."""
    counts, law = counts.double(), law.double()
    distance = sigma_distances(counts, law, n)
    names = list(range(law.numel())) if labels is None else list(labels)
    problems = []
    for x in range(law.numel()):
        if law[x] <= 0:
            if counts[x] > 0:
                problems.append(f"bin {names[x]}: {int(counts[x])} draws where the law is 0")
        elif distance[x].abs() > sigmas:
            expected, sigma = float(n * law[x]), float(distance[x])
            problems.append(f"bin {names[x]}: {int(counts[x])} vs expected {expected:.1f} ({sigma:+.1f} sigma)")
    return problems


def token_law_violations(tokens: torch.Tensor, target_probs: torch.Tensor, sigmas: float = 6.0) -> list[str]:
    """tokens: [rows, k+1] emitted by verification with every row sharing target_probs
    [k+1, vocab] (context-free rows). The token at position j, among rows that emitted
    one there, must follow target_probs[j]."""
    vocab = target_probs.shape[-1]
    problems = []
    for j in range(tokens.shape[1]):
        column = tokens[:, j]
        column = column[column >= 0]
        if column.numel() == 0:
            continue
        counts = torch.bincount(column, minlength=vocab)
        problems += [f"position {j}, {p}" for p in bin_violations(counts, target_probs[j], column.numel(), sigmas)]
    return problems


# ------------------------------------------------------------------ transformers' own law


def generate_warpers(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    """The warpers `generate(do_sample=True, temperature=, top_k=, top_p=)` builds, in its order
    (transformers.generation.utils._get_logits_processor: temperature, top-k, top-p)."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    return warpers


def generate_law(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, warpers=None
) -> torch.Tensor:
    """logits [rows, vocab] -> the float64 law generate() samples each row's next token from.
    `warpers` overrides the list (for broken variants, e.g. a reordered one)."""
    warpers = generate_warpers(temperature, top_k, top_p) if warpers is None else warpers
    scores = logits.float()
    if len(warpers):
        scores = warpers(torch.empty(scores.shape[0], 0, dtype=torch.long), scores)
    law = torch.softmax(scores, -1).double()
    if top_p is not None and top_p < 1.0:
        _check_clear_of_top_p_edge(logits.float(), top_p, warpers)
    return law


def _check_clear_of_top_p_edge(logits: torch.Tensor, top_p: float, warpers) -> None:
    """A cumulative mass within 1e-5 of the top-p edge would make the law depend on float rounding
    (batched and single-row forwards differ in the last bits): such a test setup is fragile, say so."""
    scores = logits
    for warper in warpers:
        if isinstance(warper, TopPLogitsWarper):
            break
        scores = warper(torch.empty(scores.shape[0], 0, dtype=torch.long), scores)
    cumulative = torch.softmax(scores, -1).sort(-1).values.cumsum(-1)
    gap = float((cumulative - (1 - top_p)).abs().min())
    assert gap > 1e-5, f"a cumulative mass lies {gap:.1e} from the top-p edge {top_p}: choose another top_p"


def outcome_law(
    model,
    prompt: Sequence[int],
    steps: int,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_ids: Iterable[int] = (),
    warpers=None,
) -> dict[tuple[int, ...], float]:
    """The exact law of the first `steps` generated tokens under generate(do_sample=True, ...), by
    enumerating every continuation with the model itself (vocabularies of 8-16 tokens keep it small).
    A row ends at an EOS token (kept, as transformers does), so outcomes may be shorter than `steps`."""
    eos = set(eos_ids)
    done: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}  # unfinished outcomes and their mass
    for depth in range(steps):
        live = sorted(frontier)
        with torch.inference_mode():
            ids = torch.tensor([list(prompt) + list(t) for t in live], device=model.device)
            logits = model(ids).logits[:, -1].cpu()
        law = generate_law(logits, temperature, top_k, top_p, warpers)
        grown: dict[tuple[int, ...], float] = {}
        for row, tokens in enumerate(live):
            for x, p in enumerate(law[row].tolist()):
                if p > 0:
                    finished = x in eos or depth == steps - 1
                    (done if finished else grown)[tokens + (x,)] = frontier[tokens] * p
        frontier = grown
    return done


def outcome_violations(
    outputs: Sequence[Sequence[int]], law: dict[tuple[int, ...], float], sigmas: float = 6.0
) -> list[str]:
    """Generated rows (token lists) against an outcome law: the marginal law of each position
    (its tokens, and END where rows already ended) and the joint law of whole outcomes."""
    n = len(outputs)
    observed = Counter(tuple(int(t) for t in row) for row in outputs)
    problems = [f"outcome {o}: {c} rows where the law is 0" for o, c in observed.items() if o not in law]
    steps = max(len(o) for o in law)
    for j in range(steps):
        marginal: Counter = Counter()
        for outcome, p in law.items():
            marginal[outcome[j] if j < len(outcome) else END] += p
        seen = Counter(o[j] if j < len(o) else END for o in observed.elements() if o in law)
        bins = sorted(set(marginal) | set(seen), key=str)
        counts = torch.tensor([seen[b] for b in bins], dtype=torch.float64)
        mass = torch.tensor([marginal[b] for b in bins], dtype=torch.float64)
        problems += [f"token {j + 1}, {p}" for p in bin_violations(counts, mass, n, sigmas, bins)]
    outcomes = sorted(law)
    counts = torch.tensor([observed[o] for o in outcomes], dtype=torch.float64)
    mass = torch.tensor([law[o] for o in outcomes], dtype=torch.float64)
    return problems + [f"whole outcome, {p}" for p in bin_violations(counts, mass, n, sigmas, outcomes)]
