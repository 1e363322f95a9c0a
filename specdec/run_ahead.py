"""Run-ahead: the target alone with the host one round behind the device.

Round s's forward is queued, its input the token round s - 1 sampled, still on the device; then
round s - 1's token is read and committed while the device runs round s. On a GPU the host's work
between rounds (the commit, the next forward's inputs, the launch) then no longer idles the device.
Tokens and random draws are those of the plain loop (`Decoder.run`: the same forwards and verify
calls, in the same order) while no row has finished. Rows are not dropped here (the plain loop
drops finished rows where the models can, which changes a sampled batch's later draws, not its
law). A row that finishes while its next round is queued wastes that round (its token is never
committed), and the final rollback drops what it fed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.adapters import finite_flag
from specdec.batch import Batch
from specdec.drafters import NoDrafter
from specdec.scoring import host_result, start_read, verify

if TYPE_CHECKING:
    from specdec.decoder import Decoder


def can_read_ahead(decoder: Decoder) -> bool:
    """The target alone (one token per round, so the host knows each next forward's shape), with
    warpers that need no committed prefix (the next forward is queued before the last token is read),
    and a target that can embed every id it emits (the sampled ids are fed back as they are)."""
    alone = isinstance(decoder.drafter, NoDrafter) and decoder.lookup is None
    target = decoder.target
    embeds_all = target.vocab_size <= getattr(target, "embed_size", target.vocab_size)
    return alone and decoder.warping.prefix_free and decoder.race is None and embeds_all


def run_ahead(decoder: Decoder, batch: Batch) -> None:
    """Every round of the target alone, each forward queued before the last round's token is read."""
    nothing = torch.zeros(len(batch.sequences), dtype=torch.long)
    proposal = decoder.drafter.propose(batch.sequences, nothing, None, None)  # NoDrafter: nothing
    target, step, ids, queued = decoder.target, 0, None, None
    remaining = batch.remaining()
    while True:
        active = remaining > 0  # rows whose next token the host will commit, as far as it knows
        launched = None
        if bool(active.any()):
            step += 1
            with decoder.watch.time("target_time_s"):
                if ids is None:  # the first round feeds each row's pending tokens from the host
                    logits = target.feed(batch.sequences, active)
                else:
                    logits = target.forward(ids, active[:, None])
            result = verify(logits, proposal, decoder.warping, batch.sequences, decoder.generator, decoder.verification)
            ids = result.tokens[:, :1]  # the next round's input, left on the device
            check = (f"target model {target.name}", step, finite_flag(logits, active))
            launched = start_read(result, [check]), active
        if queued is not None:
            read, was_active = queued
            result = host_result(read)
            decoder.commit(batch, was_active & ~torch.tensor(batch.finished), proposal, result)
            decoder.observe(proposal, result)
            if decoder.on_round is not None:
                decoder.on_round(batch)
        if launched is None:
            break
        queued = launched
        remaining = (batch.remaining() - launched[1].long()).clamp_min(0)  # the queued round's token counts
    decoder.rollback(batch)
