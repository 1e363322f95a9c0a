"""Calibration: this host's measured costs for a pair, from which `auto` chooses k.

Words (docs/DESIGN.md): a calibration holds the draft step and the target
forward at each verify width (batch x w tokens, after a context): one
specdec.tuning.costs.Costs, timed with that module's forward timer (synchronised
clocks, CUDA events on GPU). Given the drafter, the draft step is what one more
step adds to a proposal through the drafter itself (its model's forward plus the
warping, sampling and host reads around it: on a host-bound loop, such as a GPU
replaying captured graphs, those cost more than the forward); without it, the
draft model's forward over batch x 1 token. It is measured once per (models,
device, dtype, batch size, threads, instruction set), kept in the process and on
disk beside the model cache, and never re-measured during a run: `auto` then
learns only acceptance, from counts, so the same seed gives the same tokens
whatever the host's timings do.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.models.adapters import TargetModel
from specdec.models.resolution import cache_dir
from specdec.tuning.costs import Costs, DraftSettings, forward_seconds

WIDTHS = (1, 2, 3, 5, 7, 9, 11)  # target widths measured; others are interpolated
_memory: dict[str, Costs] = {}


def signature(model: TargetModel | None) -> str:
    """What makes two models cost the same: name, dtype, parameter count, its weight form (int8, int4:
    specdec.models.forms, as loading or the quantiser stamps it), how its float Linears run (packed, the rows
    they pad to, each timed shape's form), whether it runs the lean forward, the adapter, and its compiled
    form."""
    if model is None:
        return "none"
    module = model.model
    if module is None:  # another kind of model: its name is all we know
        return model.name
    params = list(module.parameters())
    dtype = str(params[0].dtype).replace("torch.", "") if params else "none"
    count = sum(p.numel() for p in params)
    compiled = f":compiled-{model.compile_mode}" if model.compile_mode else ""
    # What specdec.models.packing.pack_linears packed: how many Linears, the rows it pads to, each timed shape's form.
    packed_linears = getattr(module, "specdec_packed_linears", 0)
    packed = f":packed{packed_linears}" if packed_linears else ""
    rows = getattr(module, "specdec_packed_rows", 1)
    packed += f":rows{rows}" if rows > 1 else ""
    forms = getattr(module, "specdec_linear_forms", {})
    packed += ":" + ",".join(f"{shape}={form.name}" for shape, form in forms.items()) if forms else ""
    weights = getattr(module, "specdec_weights", "none")
    lean = ":lean" if model.lean is not None else ""  # forwards without transformers' plumbing
    kinds = f"{'' if weights == 'none' else ':' + weights}{packed}{lean}"
    return f"{model.name}:{dtype}:{count}{kinds}:{type(model).__name__}{compiled}"


def _key(target, draft, batch: int, drafter=None) -> str:
    device = target.device
    isa = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else torch.cuda.get_device_name(device)
    probe = "forward" if drafter is None else type(drafter).__name__
    return "|".join(
        [
            signature(target),
            signature(draft),
            probe,
            str(device),
            f"batch={batch}",
            f"threads={torch.get_num_threads()}",
            isa,
            "widths=" + ",".join(map(str, WIDTHS)),  # the target widths measured (a wider set is another key)
            "v5",  # v5: float Linears packed (oneDNN); v4: int8 projections packed; v3: the draft step through
            # the drafter; v2: interleaved minima
        ]
    )


def _path() -> Path:
    return Path(os.environ.get("SPECDEC_CALIBRATION") or cache_dir() / "calibration.json")


def _load_disk() -> dict:
    """The calibration file's entries. A file that is missing, unreadable, not JSON or not a JSON object
    counts as empty: it is a cache, so its costs are measured again and the file rewritten (a user who
    edited or damaged it expects a run, not a traceback)."""
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stored(entry) -> Costs | None:
    """An entry read back from the file, or None (measured again) where it is not what _save_disk writes."""
    try:
        target_s = tuple((int(width), float(seconds)) for width, seconds in entry["target_s"])
        costs = Costs(float(entry["draft_step_s"]), target_s, int(entry["batch"]))
    except (TypeError, KeyError, ValueError):
        return None
    return costs if [width for width, _ in target_s] == list(WIDTHS) else None


def _save_disk(key: str, costs: Costs) -> None:
    """Best effort: the disk copy only saves a later process the measurement. Written to a temporary file
    that is renamed into place (a reader never sees half a file) or removed if anything fails; created
    with the umask's permissions (a shared cache stays readable)."""
    path = _path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load_disk() | {key: costs.to_dict()}
        with open(tmp, "x") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


PROBE_STEPS = 4  # drafts in the longer of the two proposals whose difference is the draft step


def _drafter_step(drafter, batch: int, context: int, vocab: int, repeats: int) -> float | None:
    """Wall seconds one more draft adds to a proposal, through the drafter's own `propose` (greedy, no
    early stop, a chain): (t(PROBE_STEPS drafts) - t(1 draft)) / (drafts difference), in the target's
    drafts (a cross-tokenizer draft may spend more than one of its steps on one), the least over
    interleaved repeats; None where no repeat proposed more drafts the longer way (the caller then times
    the draft's forward). The drafter is left configured for chains that never stop early, its state
    reset: a run configures it again before its first round."""
    from specdec.verify.sampling import SamplingConfig, Warping  # sampling imports nothing from here

    device = drafter.adapter.device if drafter.adapter is not None else torch.device("cpu")
    cuda = device.type == "cuda"
    ids = torch.randint(0, min(1000, vocab), (batch, context), generator=torch.Generator().manual_seed(0))
    sequences = ids.tolist()
    greedy = Warping.from_sampling(SamplingConfig(temperature=0))

    def propose(k: int) -> tuple[float, int]:
        drafter.rollback(torch.full((batch,), context, dtype=torch.long))
        if cuda:
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        proposal = drafter.propose(sequences, torch.full((batch,), k, dtype=torch.long), greedy, None)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - begin, int(proposal.lengths.max()) if len(proposal.lengths) else 0

    try:
        drafter.reset(batch)
        drafter.configure(DraftSettings(width=1, stops=False))
        propose(1), propose(PROBE_STEPS)  # warm-up: the prefill, first calls of each shape
        steps = []
        for _ in range(repeats):
            (short, n1), (long, n2) = propose(1), propose(PROBE_STEPS)
            if n2 > n1:
                steps.append((long - short) / (n2 - n1))
        return min(steps) if steps and min(steps) > 0 else None
    finally:
        drafter.reset(batch)


def calibrate(
    target,
    draft=None,
    *,
    drafter=None,
    batch: int = 1,
    context: int = 128,
    repeats: int = 4,
    refresh=False,
    progress: Callable[[str], None] | None = None,
) -> Costs:
    """Measured costs for (target, draft model or None) at this batch size; cached in the process
    and on disk. `draft`: a TargetModel-like adapter (a ModelDrafter's model), or None (model-free).
    `drafter`: the drafter around `draft`, whose own step is then timed (see the module notes).
    `progress`: told, in one line, when the costs are measured rather than read from a cache."""
    key = _key(target, draft, batch, drafter if draft is not None else None)
    if not refresh:
        if key in _memory:
            return _memory[key]
        costs = _stored(_load_disk().get(key))
        if costs is not None:
            _memory[key] = costs
            return costs
    if progress is not None:
        pair = target.name if draft is None else f"{draft.name} drafting for {target.name}"
        progress(f"measuring this host's costs for {pair} at batch {batch}, once (kept in {_path()})")
    context = min(context, (target.max_positions or context + 64) - max(WIDTHS) - 1)
    with torch.inference_mode():
        if draft is None:
            draft_step = 0.0
        else:
            draft_step = None if drafter is None else _drafter_step(drafter, batch, context, target.vocab_size, repeats)
            if draft_step is None:  # no drafter given, or its probe proposed nothing to compare
                draft_step = forward_seconds(draft, batch, [1], context, repeats)[0]
        target_s = tuple(zip(WIDTHS, forward_seconds(target, batch, WIDTHS, context, repeats)))
    costs = Costs(draft_step, target_s, batch)
    _memory[key] = costs
    _save_disk(key, costs)
    return costs
