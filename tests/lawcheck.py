"""Statistical checks shared by the tests: observed counts against an exact law."""

from __future__ import annotations

import torch


def bin_violations(counts: torch.Tensor, law: torch.Tensor, n: int, sigmas: float = 6.0) -> list[str]:
    """Bins whose count is more than `sigmas` binomial standard deviations from n * law,
    plus any count in a zero-probability bin. Empty list: consistent with the law."""
    counts = counts.double()
    law = law.double()
    expected = n * law
    std = (n * law * (1 - law)).sqrt()
    problems = []
    for x in range(law.numel()):
        if law[x] == 0 and counts[x] > 0:
            problems.append(f"bin {x}: {int(counts[x])} draws where the law is 0")
        elif (counts[x] - expected[x]).abs() > sigmas * std[x] + 1e-9:
            problems.append(f"bin {x}: {int(counts[x])} vs expected {float(expected[x]):.1f} (std {float(std[x]):.1f})")
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
