"""The round's host reads: what a device computed, copied to the host in as few syncs as it can.

A round reads the device once (`PendingRead`): the verify result and the finiteness flags of every forward
it ran (`finite_flag`: one reduction each, left on the device until that read), so a NaN is reported,
naming the model and step, without a sync of its own. Host tensors travel to the device as queued copies
(`to_device`). Scoring (specdec.engine.scoring), the draft model's chain and the adapters use them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class NonFiniteLogitsError(ValueError):
    """A model produced NaN or inf logits."""


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host sync: on CUDA it is copied into pinned memory and the
    copy to the device is queued (a plain `.to(device)` waits for the stream to finish first)."""
    if device.type != "cuda" or tensor.device.type == "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def finite_flag(logits: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-d bool on the logits' device: whether the logits of these rows ([batch] bool; None: all)
    hold no NaN or inf. One reduction and no host sync: the caller reads it with its next host read
    and raises `non_finite_error` then (rows outside `rows` may hold junk)."""
    rows = None if rows is None else rows.cpu()  # pass rows from the CPU (no sync)
    if rows is not None and not bool(rows.all()):
        keep = to_device(rows, logits.device).reshape(-1, *[1] * (logits.dim() - 1))
        logits = torch.where(keep, logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.isfinite(logits.sum(dtype=torch.float32))  # one kernel, also for half-precision logits


def non_finite_error(model_name: str, step: int) -> NonFiniteLogitsError:
    return NonFiniteLogitsError(
        f"{model_name} returned NaN or inf logits at step {step}; the weights or dtype are broken (try --dtype float32)"
    )


Check = tuple[str, int, torch.Tensor]  # (model name, step, finiteness flag on the device): read later


class PendingRead:
    """A host read started now and finished by `result()`: `tensors` ([batch, n_i] each, on one device)
    and the pending finiteness checks, packed into one copy. On CUDA the copy is queued into pinned
    memory behind an event, so `result()` waits for that copy alone, not for work queued after it
    (a draft forward launched in between runs while the host waits). float64 carries every token
    id and every float32 exactly; `result()` gives each tensor back on the CPU in its own dtype."""

    def __init__(self, tensors: Sequence[torch.Tensor], checks: Sequence[Check] = ()):
        self.checks, self.tensors = list(checks), [(t.shape[1], t.dtype) for t in tensors]
        self.host, self.event = torch.zeros(1, 0, dtype=torch.float64), None
        if not tensors and not self.checks:
            return
        device = tensors[0].device if tensors else self.checks[0][2].device
        parts = [t.double() for t in tensors]
        if self.checks:  # flags of models on other devices join this one (a queued copy between GPUs)
            flags = torch.stack([flag.to(device, non_blocking=True) for *_, flag in self.checks]).double()[None]
            parts.append(flags.expand(tensors[0].shape[0] if tensors else 1, -1))
        if device.type != "cuda":
            self.host = torch.cat(parts, 1).cpu()
            return
        with torch.cuda.device(device):  # the copy and its event on this GPU's stream, whichever is current
            packed = torch.cat(parts, 1)
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def result(self) -> list[torch.Tensor]:
        """Wait for the copy; raise the first failing check's NonFiniteLogitsError (in the order the
        checks were made); return the tensors on the CPU."""
        if self.event is not None:
            self.event.synchronize()
        if self.checks and len(self.host):
            for (name, step, _), ok in zip(self.checks, self.host[0, -len(self.checks) :].tolist()):
                if not ok:
                    raise non_finite_error(name, step)
        out, start = [], 0
        for width, dtype in self.tensors:
            out.append(self.host[:, start : start + width].to(dtype))
            start += width
        return out


def read_checked(tensors: Sequence[torch.Tensor], checks: Sequence[Check] = ()) -> list[torch.Tensor]:
    """One host read of `tensors` and the pending finiteness checks, in one copy (see PendingRead)."""
    return PendingRead(tensors, checks).result()


def check_finite(logits: torch.Tensor, model_name: str, step: int, rows: torch.Tensor | None = None) -> None:
    """Raise a clear error now if logits hold NaN/inf (one host read: for paths off the device loop)."""
    if not bool(finite_flag(logits, rows)):
        raise non_finite_error(model_name, step)
