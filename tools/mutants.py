"""Plant the bugs peers shipped, one at a time, and show that the tests catch each (`make mutants`).

Each mutant is a text substitution in one file of a copy of the working tree (the
`old` text must occur exactly once; it may carry a neighbouring line only to be
unique, the change itself is one line). The mutant's tests run with `pytest -x`
in the copy; a failing test means the mutant is caught. Each mutant names the
function its pattern plants into (`function`, qualified: "Decoder.round"). A
mutant whose pattern is not found exactly once, lies outside that function (or
the function is gone), or leaves a file that does not parse is an ERROR (stale:
update MUTANTS below), never "caught". Before the mutants, the same tests must
pass on the unmutated copy.

    python tools/mutants.py                 # all, one at a time
    python tools/mutants.py --jobs 2        # two copies side by side
    python tools/mutants.py --only bonus-from-last-draft target-rollback-keeps-one-more
    python tools/mutants.py --list
    python tools/mutants.py --check         # where each plants, and its tests: checked, nothing run

Exit status 0 only if every mutant was caught and the baseline passed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAWS = "tests/test_laws.py"
VERIFY = "tests/test_verify.py"
SAMPLING = "tests/test_sampling_metrics.py"
BLOCK = "tests/test_block_race.py"
CACHES = "tests/test_laws.py::test_caches_match_fresh_forwards_in_a_sampled_ragged_batch"


@dataclass(frozen=True)
class Mutant:
    name: str
    bug_class: str
    file: str
    function: str  # qualified ("Decoder.round", "ModelDrafter._stop"): the pattern must lie inside it
    old: str
    new: str
    tests: tuple[str, ...]  # pytest arguments: files or node ids, run with -x in this order


MUTANTS = [
    # q is not the law the draft sampled from (transformers #32867, #47932)
    Mutant(
        "q-from-raw-logits",
        "q not the sampled law (#32867)",
        "specdec/drafters/__init__.py",
        "ModelDrafter.propose",
        "                probs.append(law)",
        "                probs.append(torch.softmax(logits.float(), -1))",
        (LAWS,),
    ),
    Mutant(
        "argmax-draft-scored-with-softmax",
        "q not the sampled law (#47932)",
        "specdec/drafters/__init__.py",
        "ModelDrafter._draft",
        "        token = sample(law, generator)",
        "        token = law.argmax(-1)",
        (LAWS,),
    ),
    Mutant(
        "point-mass-draft-q-half",
        "q not the sampled law (#47932)",
        "specdec/verify/__init__.py",
        "speculative_verify",
        "        draft_at = torch.ones_like(target_at)",
        "        draft_at = torch.full_like(target_at, 0.5)",
        (LAWS,),
    ),
    # warper order
    Mutant(
        "top-p-before-top-k-in-engine",
        "warper order",
        "specdec/verify/sampling.py",
        "Warping.scores",
        "            processors = self.processors(1)",
        "            processors = LogitsProcessorList(sorted(self.processors(1), "
        "key=lambda p: isinstance(p, TopKLogitsWarper)))",
        (LAWS,),
    ),
    Mutant(
        "top-p-before-top-k-in-config",
        "warper order",
        "specdec/verify/sampling.py",
        "SamplingConfig.warpers",
        "            warpers.append(TopPLogitsWarper(top_p=float(self.top_p)))",
        "            warpers.insert(len(warpers) - 1 if self.top_k else len(warpers), "
        "TopPLogitsWarper(top_p=float(self.top_p)))",
        (SAMPLING,),
    ),
    # residual formula
    Mutant(
        "residual-equals-target",
        "residual formula",
        "specdec/verify/__init__.py",
        "_subtract_draft",
        "    weights.sub_(draft_rows).clamp_(min=0)",
        "    weights.clamp_(min=0)",
        (LAWS,),
    ),
    Mutant(
        "residual-absolute-difference",
        "residual formula",
        "specdec/verify/__init__.py",
        "_subtract_draft",
        "    weights.sub_(draft_rows).clamp_(min=0)",
        "    weights.sub_(draft_rows).abs_()",
        (LAWS,),
    ),
    Mutant(
        "point-mass-residual-keeps-draft",
        "residual formula",
        "specdec/verify/__init__.py",
        "speculative_verify",
        "            weights.scatter_(1, drafted, kept.masked_fill(~bonus[:, None], 0.0))  # bonus rows keep theirs",
        "            weights.scatter_(1, drafted, kept)  # bonus rows keep theirs",
        (LAWS,),
    ),
    # bonus position
    Mutant(
        "bonus-from-last-draft",
        "bonus position",
        "specdec/verify/__init__.py",
        "speculative_verify",
        "    # One row per sequence: its residual at the first rejection, or the target law after its last draft.\n"
        "    weights = _scratch_rows(target_probs, rows, num_accepted, 0)",
        "    # One row per sequence: its residual at the first rejection, or the target law after its last draft.\n"
        "    weights = _scratch_rows(target_probs, rows, (num_accepted - bonus.long()).clamp(min=0), 0)",
        (LAWS,),
    ),
    Mutant(
        "greedy-bonus-from-last-draft",
        "bonus position",
        "specdec/verify/__init__.py",
        "greedy_verify",
        "    last = argmax.gather(1, num_accepted[:, None]).squeeze(1)",
        "    last = argmax.gather(1, (num_accepted - (num_accepted == lengths).long()).clamp(min=0)[:, None])"
        ".squeeze(1)",
        (VERIFY,),
    ),
    # a check made on the device and never read back
    Mutant(
        "draft-finiteness-not-read",
        "NaN logits unreported",
        "specdec/engine/decoder.py",
        "Decoder.round",
        "        result = to_host(result, [*proposal.checks, check])",
        "        result = to_host(result, [check])",
        ("tests/test_engine.py::test_non_finite_logits_name_the_model_and_step",),
    ),
    Mutant(
        "read-ahead-commits-after-finish",
        "tokens after EOS",
        "specdec/engine/decoder.py",
        "Row.remaining",
        "        return 0 if self.finished else self.max_new_tokens - (len(self.sequence) - len(self.prompt))",
        "        return self.max_new_tokens - (len(self.sequence) - len(self.prompt))",
        ("tests/test_read_ahead.py",),
    ),
    Mutant(
        "read-ahead-with-prefix-warpers",
        "stale prefix",
        "specdec/engine/decoder.py",
        "Decoder.can_read_ahead",
        "        return alone and self.warping.prefix_free and self.race is None and embeds_all",
        "        return alone and self.race is None and embeds_all",
        ("tests/test_read_ahead.py",),
    ),
    # rollback off by one, on either model
    Mutant(
        "target-rollback-keeps-one-more",
        "rollback off by one (target)",
        "specdec/engine/decoder.py",
        "Decoder.rollback",
        "        self.target.commit(committed - 1, path)",
        "        self.target.commit(committed, path)",
        (LAWS,),
    ),
    Mutant(
        "draft-rollback-keeps-one-more",
        "rollback off by one (draft)",
        "specdec/drafters/__init__.py",
        "ModelDrafter.rollback",
        "torch.minimum(self.adapter.lengths, committed_lengths.cpu() - 1)",
        "torch.minimum(self.adapter.lengths, committed_lengths.cpu())",
        (CACHES,),
    ),
    Mutant(
        "adapter-rollback-keeps-slot-at-keep-len",
        "rollback off by one (both)",
        "specdec/models/adapters/__init__.py",
        "HFCausalLM.rollback",
        "self.slot_pos = torch.where(self.slot_pos < keep_len[:, None], self.slot_pos, -1)",
        "self.slot_pos = torch.where(self.slot_pos <= keep_len[:, None], self.slot_pos, -1)",
        (LAWS,),
    ),
    # EOS handling
    Mutant(
        "eos-keeps-rest-of-window",
        "EOS handling",
        "specdec/engine/decoder.py",
        "Row.commit",
        "                tokens, self.finished = tokens[: i + 1], True",
        "                tokens, self.finished = tokens, True",
        (LAWS,),
    ),
    Mutant(
        "eos-ignored-at-round-start",
        "EOS handling",
        "specdec/engine/decoder.py",
        "Row.commit",
        "            if token in eos_ids:",
        "            if token in eos_ids and i > 0:",
        (LAWS,),
    ),
    # batch hole masks
    Mutant(
        "holes-attended",
        "batch hole masks",
        "specdec/models/adapters/__init__.py",
        "HFCausalLM.forward",
        "        mask = torch.cat([self.slot_pos >= 0, valid], 1).long()",
        "        mask = torch.cat([self.slot_pos >= -1, valid], 1).long()",
        (LAWS,),
    ),
    Mutant(
        "holes-counted-in-positions",
        "batch hole masks",
        "specdec/models/adapters/__init__.py",
        "HFCausalLM.forward",
        "        positions = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [batch, n]",
        "        positions = self.lengths[:, None] + torch.ones_like(valid).long().cumsum(1) - 1  # [batch, n]",
        (LAWS,),
    ),
    # seeds reused across rows
    Mutant(
        "sampler-uniforms-shared-by-rows",
        "seeds reused across rows",
        "specdec/verify/sampling.py",
        "sample",
        "    uniforms = torch.rand(2, rows, dtype=torch.float64, generator=generator, device=flat.device)",
        "    uniforms = torch.rand(2, 1, dtype=torch.float64, generator=generator, device=flat.device).expand(2, rows)",
        ("tests/test_verify.py::test_sample_draws_the_given_law_over_a_small_and_a_large_vocabulary",),  # two levels
    ),
    Mutant(
        "small-vocab-sampler-uniforms-shared-by-rows",
        "seeds reused across rows",
        "specdec/verify/sampling.py",
        "sample",
        "        uniforms = torch.rand(flat.shape[0], dtype=torch.float64, generator=generator, device=flat.device)",
        "        uniforms = torch.rand(1, dtype=torch.float64, generator=generator).expand(flat.shape[0])",
        (LAWS,),
    ),
    Mutant(
        "accept-uniforms-shared-by-rows",
        "seeds reused across rows",
        "specdec/verify/__init__.py",
        "speculative_verify",
        "    # float64 uniforms: float32 rand can return values whose spacing biases the test near 1.\n"
        "    uniforms = torch.rand(batch, k, dtype=torch.float64, generator=generator, device=target_probs.device)",
        "    # float64 uniforms: float32 rand can return values whose spacing biases the test near 1.\n"
        "    uniforms = torch.rand(1, k, dtype=torch.float64, generator=generator, device=target_probs.device)"
        ".expand(batch, k)",
        (LAWS,),
    ),
    # the stop-string cut
    Mutant(
        "stop-string-cut-drops-completing-token",
        "stop-string cut",
        "specdec/text.py",
        "StopStrings.__call__",
        "                return first_new + keep - prompt_length",
        "                return first_new + keep - prompt_length - 1",
        (LAWS,),
    ),
    # block verification (Sun et al. 2024)
    Mutant(
        "block-residual-without-scale",
        "block residual formula",
        "specdec/verify/__init__.py",
        "_residual_scale",
        "    return padded.gather(1, num_accepted[:, None]).squeeze(1).float()",
        "    return torch.ones_like(num_accepted, dtype=torch.float32)",
        (BLOCK, LAWS),
    ),
    Mutant(
        "block-threshold-is-the-scale",
        "block threshold",
        "specdec/verify/__init__.py",
        "_block_thresholds",
        "    thresholds = torch.where(length == lengths[:, None], scales, stop)",
        "    thresholds = scales.clone()",
        (BLOCK, LAWS),
    ),
    # race sampling (Kobus & Gunduz 2025)
    Mutant(
        "race-noise-reused-across-positions",
        "race keys",
        "specdec/engine/scoring.py",
        "verify",
        "        positions = starts[:, None] + torch.arange(logits.shape[1], device=logits.device)  # [batch, k + 1]",
        "        positions = starts[:, None] + torch.zeros(logits.shape[1], dtype=torch.long, device=logits.device)"
        "  # [batch, k + 1]",
        (LAWS,),
    ),
    Mutant(
        "race-equal-prompts-share-a-key",
        "seeds reused across rows",
        "specdec/verify/race.py",
        "Race.for_prompts",
        "            word = occurrence",
        "            word = 0",
        (LAWS,),
    ),
    Mutant(
        "race-own-seed-keyed-by-place-among-equal-prompts",
        "seeds reused across rows",
        "specdec/verify/race.py",
        "Race.for_prompts",
        "            occurrence = seen.get(ids, 0) if own_seed is None else 0",
        "            occurrence = sum(tuple(int(t) for t in q) == ids for q in prompts[: len(keys)])",
        (  # generate()'s rows; a session keys each request on its own prompt alone
            "tests/test_rows.py::test_a_row_in_a_batch_with_other_rows_is_keyed_as_alone",
            "tests/test_batching.py::test_equal_prompts_with_their_own_seeds_are_each_keyed_as_alone",
        ),
    ),
    # per-row options: rows of equal sampling but other budgets share one warping (budget-bound processors)
    Mutant(
        "rows-share-a-warping-across-budgets",
        "per-row options",
        "specdec/rows.py",
        "sampling_key",
        "    return config.max_new_tokens, tuple(sorted((k, repr(v)) for k, v in config.sampling.items()))",
        "    return tuple(sorted((k, repr(v)) for k, v in config.sampling.items()))",
        (
            "tests/test_batching.py::test_rows_of_equal_sampling_and_other_budgets_keep_their_own_budget_bound_processors",
        ),
    ),
    # draft trees: siblings matched against the target's law after the chain draft was rejected
    Mutant(
        "tree-siblings-skip-the-residual",
        "residual",
        "specdec/verify/__init__.py",
        "tree_verify",
        "                    p = residual if residual.sum() > 0 else p",
        "                    p = p",
        (VERIFY, LAWS),
    ),
    # draft trees: the target keeps the rejected chain draft's slot instead of the accepted sibling's
    Mutant(
        "tree-keeps-the-wrong-path",
        "rollback",
        "specdec/engine/trees.py",
        "path_nodes",
        "    keep[on_path.nonzero()[:, 0], result.path[on_path]] = True",
        "    keep[on_path.nonzero()[:, 0], result.path[on_path].clamp(max=proposal.lengths.min() - 1)] = True",
        (CACHES,),
    ),
    # auto's draft-past-k extension leaks into a fixed k: a user's num_draft_tokens=4 drafts up to max_k
    Mutant(
        "fixed-k-extended",
        "a fixed k not honoured",
        "specdec/tuning/policy.py",
        "DraftLengthPolicy.extension",
        "        if self.k is not None or k == 0:",
        "        if k == 0:",
        ("tests/test_policy.py",),
    ),
    # auto's per-position rates count a draft as kept when only the draft before it was: every later
    # draft looks sure, and k runs to max_k on any text
    Mutant(
        "position-rate-counts-the-one-before",
        "auto's k learned from miscounted acceptance",
        "specdec/tuning/policy.py",
        "DraftLengthPolicy.observe",
        "        kept = [float(sum(1 for a, _ in rows if a >= j)) for j in positions]",
        "        kept = [float(sum(1 for a, _ in rows if a >= j - 1)) for j in positions]",
        ("tests/test_policy.py",),
    ),
    # a captured forward's mask forgets causality inside the new columns (the graphs path)
    Mutant(
        "graph-mask-not-causal",
        "attention mask wrong in a captured forward",
        "specdec/models/adapters/capture.py",
        "Captures._graph_mask",
        "        allowed = (real[:, None, :] & (offset <= start)) | own",
        "        allowed = real[:, None, :] | own",
        ("tests/test_static_cache.py::test_graph_buffers_greedy_equals_transformers_greedy",),
    ),
    # a stop string whose last character the tokenizer splits into bytes is missed across rounds
    Mutant(
        "stop-split-character-missed",
        "stop string missed at a round boundary",
        "specdec/text.py",
        "StopStrings.__call__",
        '        head = len(self._decode(sequence[begin:first_new]).rstrip("\\ufffd"))',
        "        head = len(self._decode(sequence[begin:first_new]))",
        ("tests/test_decoder_api.py::test_stop_string_found_whatever_the_round_boundaries",),
    ),
    # the opt-in int8 target quantised like a draft: its massive-activation Linears lose their precision
    Mutant(
        "int8-target-outliers-quantised",
        "quantised target further from its model",
        "specdec/loading.py",
        "adapter_for",
        '            keep_outliers=role == "target",  # a quantised target is the output\'s model: keep it faithful',
        "            keep_outliers=False,",
        ("tests/test_quantize.py",),
    ),
    # copy drafts after a sampled chain verified with an empty law (q = 0 at the copy: p / q judges it as sure)
    Mutant(
        "copy-drafts-without-their-law",
        "q not the sampled law (#32867)",
        "specdec/drafters/lookup.py",
        "copy_laws",
        "        laws[row, torch.arange(start, start + len(copy)), torch.tensor(copy, dtype=torch.long)] = 1",
        "        pass",
        (f"{LAWS}::test_output_law_matches_transformers",),
    ),
    # the draft-length policy counts copy drafts as its own: copies would bend k
    Mutant(
        "policy-learns-from-copies",
        "auto's k learned from miscounted acceptance",
        "specdec/engine/decoder.py",
        "Decoder.observe",
        "        self.plan.policy.observe(result, proposal.chain_lengths)",
        "        self.plan.policy.observe(result, proposal.lengths)",
        ("tests/test_lookup.py",),
    ),
    # a hand-written forward that drops the padding mask: left-padded rows attend to pad slots
    Mutant(
        "lean-mask-ignores-padding",
        "a batch's rows leak into each other",
        "specdec/models/lean.py",
        "sdpa_mask",
        "    return causal & mask.bool()[:, None, None, :] if padded else causal",
        "    return causal",
        ("tests/test_lean.py",),
    ),
    # the lean forward runs while a user hooks the model: the hook silently never fires
    Mutant(
        "lean-runs-under-hooks",
        "a user's model changed behind their back",
        "specdec/models/lean.py",
        "LeanForward.runs",
        "        return not (watched or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)",
        "        return True",
        ("tests/test_lean.py",),
    ),
    # a serving batch's measured costs take a stall whole: one dear draft step prices drafting out, and rounds
    # without drafts never time the draft again (the session serves at the target alone's speed for good)
    Mutant(
        "measured-costs-take-stalls-whole",
        "a cost not counted",
        "specdec/tuning/costs.py",
        "MeasuredCosts._average",
        "        return new if old is None else self.decay * old + (1 - self.decay) * min(new, self.SPIKE * old)",
        "        return new if old is None else self.decay * old + (1 - self.decay) * new",
        ("tests/test_costs.py",),
    ),
    # auto k's extension priced for one row in a batch: one confident row widens every row's verify
    Mutant(
        "extension-bar-per-row",
        "a cost not counted",
        "specdec/engine/decoder.py",
        "Decoder.propose",
        "        extension = None if extension is None else (extension[0], extension[1] * rows)",
        "        extension = None if extension is None else (extension[0], extension[1])",
        ("tests/test_drafter_protocol.py",),
    ),
    # the one pays rule (specdec.tuning.costs.columns_that_pay) forgets what a column costs: copies and
    # siblings fill every verify up to its widest, on hosts where a wider verify is dear too
    Mutant(
        "pays-rule-ignores-the-column-cost",
        "a cost not counted",
        "specdec/tuning/costs.py",
        "columns_that_pay",
        "        if surplus(value, tokens, cost, extra) <= 0:",
        "        if surplus(value, tokens, cost, 0.0) <= 0:",
        ("tests/test_costs.py", "tests/test_lookup.py"),
    ),
    # the one rate counter (specdec.tuning.costs.RateCounter.rate) gives its prior the weight of one trial:
    # a single rejection then pins the policy's k and the copies' rates far below what they are
    Mutant(
        "rate-counter-underweights-its-prior",
        "auto's k learned from miscounted acceptance",
        "specdec/tuning/costs.py",
        "RateCounter.rate",
        "        rate = (self.successes[bin] + self.weight * prior) / (self.trials[bin] + self.weight)",
        "        rate = (self.successes[bin] + prior) / (self.trials[bin] + self.weight)",
        ("tests/test_costs.py", "tests/test_policy.py"),
    ),
    # a packed group (int8, or float q/k/v and gate/up) serves a part computed for another input (a stale activation)
    Mutant(
        "packed-int8-serves-a-stale-input",
        "stale state",
        "specdec/models/packing.py",
        "SharedInputs.output",
        "        if x is not self._input or part not in self._pending:",
        "        if self._outputs is None:",
        ("tests/test_quantize.py",),
    ),
    # the vectorised n-gram lookup compares one token fewer than the n-gram it reports
    Mutant(
        "ngram-find-skips-a-token",
        "off by one",
        "specdec/drafters/__init__.py",
        "NgramDrafter.find",
        "            for j in range(1, n):",
        "            for j in range(1, n - 1):",
        ("tests/test_properties.py", "tests/test_engine.py"),
    ),
    # the n-gram drafter's stop weighs every match by the one-token matches' rates
    Mutant(
        "ngram-stop-ignores-match-length",
        "wrong estimate",
        "specdec/drafters/__init__.py",
        "NgramDrafter.worth_drafting",
        "        first, later = self.first.rate(match_bin), self.continuation.rate(match_bin)",
        "        first, later = self.first.rate(0), self.continuation.rate(0)",
        ("tests/test_ngram.py",),
    ),
    Mutant(
        "packed-linear-drops-its-bias",
        "wrong function",
        "specdec/models/packing.py",
        "PackedLinear.forward",
        '        return _LINEAR(x, self.packed, self.bias, "none", [], "")',
        '        return _LINEAR(x, self.packed, None, "none", [], "")',
        ("tests/test_packing.py",),
    ),
    Mutant(
        "conv1d-packed-untransposed",
        "wrong function",
        "specdec/models/packing.py",
        "_weight",
        "    return module.weight if isinstance(module, torch.nn.Linear) else module.weight.t()",
        "    return module.weight",
        ("tests/test_packing.py",),
    ),
    Mutant(
        "linear-forms-choose-the-slowest",
        "speed by measurement",
        "specdec/models/packing.py",
        "fastest_of",
        "    best = min(seconds, key=seconds.get)",
        "    best = max(seconds, key=seconds.get)",
        ("tests/test_packing.py",),
    ),
    Mutant(
        "packing-releases-a-tied-head",
        "memory",
        "specdec/models/packing.py",
        "pack_linears",
        "        if release is not None and linear.weight.data_ptr() not in shared:",
        "        if release is not None:",
        ("tests/test_packing.py",),
    ),
    # serving: the newcomer's leak (issue 48), and chunked prefill
    Mutant(
        "stop-trimmer-slices-a-short-prompt-from-the-end",
        "stop strings",
        "specdec/serving/openai_schema.py",
        "StopTrimmer._tail",
        '        return text[-self.hold :] if self.hold else ""',
        '        return text[len(text) - self.hold :] if self.hold else ""',
        ("tests/test_properties.py", "tests/test_serve_trust.py"),
    ),
    Mutant(
        "a-prefilling-row-commits-from-a-chunk",
        "chunked prefill",
        "specdec/engine/decoder.py",
        "Decoder.round",
        "        remaining = self.remaining() * ~filling",
        "        remaining = self.remaining()",
        ("tests/test_batching.py",),
    ),
    # log-probabilities read from the wrong column of the verify forward (the law after the token, not before)
    Mutant(
        "logprob-read-one-column-late",
        "logprobs",
        "specdec/engine/decoder.py",
        "columns",
        "        return list(range(emitted))",
        "        return list(range(1, emitted + 1))",
        ("tests/test_logprobs.py",),
    ),
    Mutant(
        "tree-logprob-read-at-the-nodes-own-column",
        "logprobs",
        "specdec/engine/decoder.py",
        "columns",
        "    return [0] + [1 + node for node in path[: emitted - 1]]",
        "    return [0] + [node for node in path[: emitted - 1]]",
        ("tests/test_logprobs.py",),
    ),
    Mutant(
        "bonus-told-as-recovered",
        "token kinds",
        "specdec/engine/decoder.py",
        "token_kinds",
        '        kinds.append("target" if drafted == 0 else ("bonus" if bonus else "recovered"))',
        '        kinds.append("target" if drafted == 0 else ("recovered" if bonus else "bonus"))',
        ("tests/test_logprobs.py",),
    ),
    # structured output: the grammar's state must be the one at each scored position's own prefix
    Mutant(
        "grammar-mask-reads-one-token-early",
        "structured output",
        "specdec/verify/grammar.py",
        "GrammarMask.refused",
        "        bitmask = self.allowed(output)",
        "        bitmask = self.allowed(output[:-1])",
        ("tests/test_grammar.py",),
    ),
    Mutant(
        "grammar-rollback-one-short",
        "structured output",
        "specdec/verify/grammar.py",
        "GrammarMask._matcher",
        "            best[1].rollback(len(best[0]) - shared)",
        "            best[1].rollback(len(best[0]) - shared - 1)",
        ("tests/test_grammar.py",),
    ),
    Mutant(
        "unfinished-structured-reply-called-stop",
        "structured output",
        "specdec/serving/server.py",
        "_finish_reason",
        "    if ended and not trimmer.stopped and completion.grammar is not None and not completion.grammar.complete(ids):",  # noqa: E501
        "    if ended and not trimmer.stopped and completion.grammar is not None and completion.grammar.complete(ids):",  # noqa: E501
        ("tests/test_grammar.py",),
    ),
    # kept packed weights read back after their source changed: another model's weights, silently
    Mutant(
        "kept-packs-from-a-stale-source",
        "stale kept weights",
        "specdec/models/ready.py",
        "KeptPacks._read",
        '        if header["source"] != self.stamp:',
        "        if False:",
        ("tests/test_ready.py::test_packed_weights_are_kept_read_back_equal_and_packed_again_for_another_source",),
    ),
    # kept packed weights read without checking that this host packs them so: another layout's bytes, silently
    Mutant(
        "kept-packs-unchecked-against-this-host",
        "stale kept weights",
        "specdec/models/ready.py",
        "KeptPacks._same",
        '            if md != entry["md"] or data != kept:',
        "            if False:",
        ("tests/test_ready.py::test_kept_packs_that_this_host_would_pack_otherwise_are_packed_again",),
    ),
]


# ------------------------------------------------------------------ running


def copy_tree(destination: Path) -> None:
    """The working tree as it is now (tracked and untracked, not ignored files) -> destination."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for relative in filter(None, listing.split("\0")):
        source = ROOT / relative
        if source.is_file():  # skips files deleted in the working tree and submodule directories
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def environment(copy: Path, threads: int) -> dict[str, str]:
    # One thread by default: the models are tiny, and two OpenMP threads on a busy 2-core host
    # spin against each other (a 25x slower forward was measured here).
    return dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=str(threads))


def check_imports_copy(copy: Path, env: dict[str, str]) -> None:
    """The copy's specdec must be the one imported (not the editable install of the repo)."""
    found = subprocess.run(
        [sys.executable, "-c", "import specdec; print(specdec.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy at {copy} imports specdec from {found}; mutants would not be tested")


def run_pytest(copy: Path, env: dict[str, str], tests: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
    """-> (pytest exit status, first failing test id or '', seconds); status -1 on timeout."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "", time.perf_counter() - start
    seconds = time.perf_counter() - start
    first = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    return done.returncode, first.group(1) if first else "", seconds


def function_spans(source: str, qualified: str) -> list[tuple[int, int]]:
    """The line spans (first, last; decorators included) of every function named `qualified` in source:
    "Class.method", "function" or "outer.inner"."""
    spans = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = prefix + child.name
                if name == qualified and not isinstance(child, ast.ClassDef):
                    spans.append((min([child.lineno, *(d.lineno for d in child.decorator_list)]), child.end_lineno))
                walk(child, name + ".")
            else:  # an if or try block: its definitions keep the enclosing name
                walk(child, prefix)

    walk(ast.parse(source), "")
    return spans


def stale(path: Path, mutant: Mutant) -> str | None:
    """Why the mutant cannot be planted in the file at path (None: it can). Its pattern must occur
    exactly once, inside the one function the mutant names, and the mutated file must still parse."""
    if not path.is_file():
        return f"{mutant.file} not found"
    source = path.read_text()
    matches = source.count(mutant.old)
    if matches != 1:
        return f"pattern not found ({matches} matches, need exactly 1)"
    spans = function_spans(source, mutant.function)
    if len(spans) != 1:
        return f"function {mutant.function} {'not found' if not spans else f'defined {len(spans)} times'}"
    offset = source.index(mutant.old)
    first = source.count("\n", 0, offset) + 1
    last = source.count("\n", 0, offset + len(mutant.old.rstrip("\n"))) + 1
    start, end = spans[0]
    if not start <= first <= last <= end:
        return f"pattern at lines {first}-{last}, outside {mutant.function} (lines {start}-{end})"
    try:
        ast.parse(source.replace(mutant.old, mutant.new))
    except SyntaxError as error:
        return f"the mutated file does not parse: {error.msg} (line {error.lineno})"
    return None


def missing_tests(mutant: Mutant) -> list[str]:
    """The mutant's test arguments that name no test file, or no test function in it, in this checkout."""
    missing = []
    for argument in mutant.tests:
        file, *nodes = argument.split("::")
        path = ROOT / file
        test = nodes[-1].split("[")[0] if nodes else None  # a parametrised id: its function
        defined = re.compile(rf"^\s*(async )?def {re.escape(test or '')}\(", re.MULTILINE)
        if not path.is_file() or (test and not defined.search(path.read_text())):
            missing.append(argument)
    return missing


def check(mutants: list[Mutant]) -> int:
    """--check: every pattern planted where its mutant says, every test named exists; nothing runs."""
    bad = 0
    for mutant in mutants:
        problems = [stale(ROOT / mutant.file, mutant)] + [f"no test {a}" for a in missing_tests(mutant)]
        problems = [p for p in problems if p]
        bad += bool(problems)
        verdict = "ERROR: " + "; ".join(problems) if problems else "ok"
        print(f"{mutant.name:42} {mutant.file}:{mutant.function}: {verdict}")
    print(f"\n{len(mutants) - bad}/{len(mutants)} mutants plant where they say")
    return 0 if bad == 0 else 1


def run_mutant(copy: Path, env: dict[str, str], mutant: Mutant, timeout: float) -> dict:
    row = {"mutant": mutant.name, "class": mutant.bug_class, "file": mutant.file, "caught_by": "", "seconds": 0.0}
    row["function"] = mutant.function
    path = copy / mutant.file
    problem = stale(path, mutant)
    if problem is not None:
        return row | {"result": f"ERROR: stale mutant: {problem}"}
    original = path.read_text()
    path.write_text(original.replace(mutant.old, mutant.new))
    try:
        status, first, seconds = run_pytest(copy, env, mutant.tests, timeout)
    finally:
        path.write_text(original)
    row["seconds"] = round(seconds, 1)
    if status == -1:
        return row | {"result": f"TIMEOUT after {timeout:.0f} s"}
    if status == 1:
        return row | {"result": "caught", "caught_by": first}
    if status == 0:
        return row | {"result": "SURVIVED"}
    return row | {"result": f"ERROR: pytest exit status {status}", "caught_by": first}


def union(mutants: list[Mutant]) -> tuple[str, ...]:
    """Every test argument once; node ids inside a file that runs whole are dropped."""
    args = list(dict.fromkeys(a for m in mutants for a in m.tests))
    files = {a for a in args if "::" not in a}
    return tuple(a for a in args if "::" not in a or a.split("::")[0] not in files)


def table(rows: list[dict], markdown: bool) -> str:
    columns = ["mutant", "class", "file", "result", "caught_by", "seconds"]
    cells = [[str(r[c]) for c in columns] for r in rows]
    if markdown:  # names, files and test ids in code spans
        quoted = [[f"`{c}`" if c and i in (0, 2, 4) else c for i, c in enumerate(r)] for r in cells]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in quoted])
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    return "\n".join(lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells])


def parse_options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="check where each plants and its tests, run nothing")
    parser.add_argument("--jobs", type=int, default=1, help="copies run side by side (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per pytest (default 1: tiny models)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    options = parser.parse_args()
    unknown = set(options.only or []) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {', '.join(sorted(unknown))}")
    return options


def run_all(chosen: list[Mutant], options: argparse.Namespace) -> list[dict] | None:
    """The baseline, then each mutant in a copy of the tree -> one row per mutant (None: the baseline failed)."""
    jobs, threads = max(1, min(options.jobs, len(chosen))), options.threads
    scratch = Path(tempfile.mkdtemp(prefix="specdec-mutants-"))
    try:
        copies = [scratch / f"copy{i}" for i in range(jobs)]
        for copy in copies:
            copy_tree(copy)
            check_imports_copy(copy, environment(copy, threads))
        print(f"{len(chosen)} mutants, {jobs} job(s), {threads} thread(s) each, copies under {scratch}", flush=True)
        if not options.no_baseline:
            tests = union(chosen)
            status, first, seconds = run_pytest(copies[0], environment(copies[0], threads), tests, options.timeout)
            print(f"baseline (unmutated): pytest exit {status} in {seconds:.0f} s", flush=True)
            if status != 0:
                print(f"ERROR: the unmutated tree fails {first or ' '.join(tests)}; fix that first", file=sys.stderr)
                return None

        def work(index: int) -> list[dict]:
            copy, rows = copies[index], []
            for mutant in chosen[index::jobs]:
                row = run_mutant(copy, environment(copy, threads), mutant, options.timeout)
                print(f"  {row['mutant']}: {row['result']} {row['caught_by']} ({row['seconds']} s)", flush=True)
                rows.append(row)
            return rows

        with ThreadPoolExecutor(jobs) as pool:
            return [row for part in pool.map(work, range(jobs)) for row in part]
    finally:
        if not options.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    options = parse_options()
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), "mutant names must be unique"
    chosen = [m for m in MUTANTS if not options.only or m.name in options.only]
    if options.list:
        for m in chosen:
            print(f"{m.name:42} {m.bug_class:32} {m.file + ':' + m.function:56} {' '.join(m.tests)}")
        return 0
    if options.check:
        return check(chosen)
    started = time.perf_counter()
    rows = run_all(chosen, options)
    if rows is None:
        return 2
    rows.sort(key=lambda r: names.index(r["mutant"]))
    print()
    print(table(rows, options.markdown))
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"\n{caught}/{len(rows)} mutants caught in {time.perf_counter() - started:.0f} s")
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
