"""Model adapters: a Hugging Face causal LM with its KV cache and rollback.

Words:
- slot: one column of the KV cache. Rows of a batch share slots; a slot that
  holds no real token of a row (left padding, a rejected draft of another
  row's round) is a hole, masked out of attention for that row.
- length (per row): real tokens in the cache; the next token's position id.
- pending tokens: committed tokens not yet in the cache, fed first on the
  next forward.
- host bookkeeping: `lengths` and `slot_pos` live on the CPU, whatever the
  model's device. The host knows what it fed and what it kept, so a forward
  or a rollback never waits on the device to learn a length; positions and
  masks travel to the device as queued copies (`to_device`).

Invariant (checked by the tests): after `rollback(keep_len)`, row b holds
exactly the first keep_len[b] committed tokens, and feeding the pending
tokens gives the same next-token logits as a fresh forward over the committed
tokens. With one row there are never holes: rollback is a plain crop.

All transformers cache specifics (DynamicCache, `crop` taking a negative
count in 5.x, the `cache=` keyword) stay in this module.

Sliding-window attention (Mistral, Gemma 2/3, Qwen2 with use_sliding_window):
transformers' sliding cache layers evict the states a rollback would need, so
every layer keeps all its states here and the window lives in the attention
mask instead, measured in positions (holes and tree siblings make slot indices
differ from positions): one additive mask per attention kind. A family whose
state cannot be cut back to a length (Mamba's recurrent state, linear-attention
hybrids, chunked attention) is refused by `attention_windows` before any work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from specdec.models.lean import lean_forward
from specdec.verify.reads import to_device

PAD_ID = 0  # any in-vocabulary id; padded slots are masked out


@runtime_checkable
class TargetModel(Protocol):
    """Everything the decoder, the drafters and the bench call on a model (HFCausalLM is the
    implementation; a draft LM is wrapped in the same adapter by ModelDrafter): feed tokens, get
    logits, keep a tree's path, roll back, and let rows join and leave.

    Declared, never probed: supports_trees (feed takes `extra_parents`, and keep_path works);
    can_select_rows (select_rows and add_rows work: a static cache keeps its rows)."""

    name: str
    vocab_size: int
    embed_size: int  # ids it can embed (some models' heads are wider than their embeddings)
    device: torch.device
    max_positions: int | None  # the context length (None: unbounded)
    lengths: torch.Tensor  # [batch] real tokens in the cache per row (on the CPU)
    supports_trees: bool
    can_select_rows: bool
    model: object  # the transformers model whose generation config sets sampling (None: another kind of model)
    progress: Callable[[str], None] | None  # where it announces the shapes it captures (None: silent)
    compile_seconds: float  # spent capturing forward shapes so far
    compile_mode: str | None  # how its forwards are captured or compiled (None: eager)
    lean: object | None  # the lean llama-family forward it runs (specdec.models.lean; None: transformers')

    def reset(self, batch: int) -> None: ...

    def feed(
        self,
        sequences: Sequence[Sequence[int]],
        active: torch.Tensor,
        extra: torch.Tensor | None = None,
        extra_valid: torch.Tensor | None = None,
        keep_logits: int = 1,
        extra_parents: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, keep_logits: int = 1) -> torch.Tensor: ...

    def keep_path(self, keep: torch.Tensor) -> None: ...

    def rollback(self, keep_len: torch.Tensor) -> None: ...

    def commit(self, keep_len: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """After a round: keep the tree's path (`keep_path`; None after a chain), then at most keep_len[b]
        tokens per row (`rollback`)."""

    def select_rows(self, rows: torch.Tensor) -> None: ...

    def add_rows(self, count: int) -> None: ...


POSITIONS_FROM_MASK = ("bloom",)  # position-id-free models whose ALiBi counts positions along the attention mask
ROLLBACK_KINDS = ("full_attention", "sliding_attention")  # attention kinds whose KV cache crops to a length


class UnsupportedModelError(ValueError):
    """A model family whose cache the engine cannot roll back."""


def attention_windows(model: PreTrainedModel) -> dict[str, int | None]:
    """The model's attention kinds -> their window in tokens (None: full attention). Raises
    UnsupportedModelError, naming the family, where a rejected draft could not be undone."""
    config = model.config.get_text_config(decoder=True)
    family = getattr(config, "model_type", None) or type(model).__name__
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{family} models keep a recurrent state that cannot be cut back to an earlier length, so rejected "
            "drafts could not be undone; specdec needs a causal LM with a KV cache (use model.generate() for this one)"
        )
    kinds, kwargs = get_layer_types_and_kwargs(config)
    windows: dict[str, int | None] = {}
    for kind, extra in zip(kinds, kwargs):
        if kind not in ROLLBACK_KINDS:
            raise UnsupportedModelError(
                f"{family} models have {kind!r} layers, whose cache cannot be rolled back to an earlier length; "
                f"specdec supports {' and '.join(ROLLBACK_KINDS)} layers (use model.generate() for this one)"
            )
        window = extra.get("sliding_window") if kind == "sliding_attention" else None
        if windows.setdefault(kind, window) != window:
            raise UnsupportedModelError(f"{family} models with several sliding-window sizes are not supported")
    return windows


def cache_keyword(model: PreTrainedModel) -> str:
    # transformers 5.x renamed past_key_values= to cache=.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class HFCausalLM:
    """Any transformers causal LM (GPT-2, Llama, Qwen2, ...) with a DynamicCache."""

    supports_trees = True  # forward(parents=...) and keep_path (per model: see __init__)
    can_select_rows = True  # rows leave (select_rows) and join (add_rows) between rounds
    progress = None  # told of each forward shape captured (the static cache with compile; here: none)
    compile_seconds = 0.0  # spent capturing forward shapes (the static cache with compile; here: none)
    compile_mode: str | None = None  # eager (the static cache's compile= sets it)

    def __init__(self, model: PreTrainedModel, name: str | None = None):
        self.model = model.eval()
        self.name = name or getattr(model.config, "_name_or_path", None) or type(model).__name__
        head = model.get_output_embeddings()  # out_features also covers int8-quantised heads
        self.vocab_size = getattr(head, "out_features", None) or head.weight.shape[0]
        self.embed_size = model.get_input_embeddings().num_embeddings
        # Inputs go where the embeddings live; with accelerate's device_map the logits may come
        # out on another device, and are brought back here.
        self.device = model.get_input_embeddings().weight.device
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or getattr(
            model.config, "n_positions", None
        )
        self._cache_kw = cache_keyword(model)
        # forward(parents=...) and keep_path: a tree's siblings share a position, which ALiBi models (Bloom,
        # MPT, Falcon with alibi) cannot be told: they count positions along the mask themselves.
        takes_positions = "position_ids" in inspect.signature(model.forward).parameters
        self.supports_trees = (
            type(self).supports_trees and takes_positions and not getattr(model.config, "alibi", False)
        )
        # A model that places keys by cache slot (MPT's ALiBi) is shifted by the gaps a batch leaves (padding,
        # other rows' rejected drafts); Bloom and Falcon count positions along the mask instead.
        self.batches = takes_positions or getattr(model.config, "model_type", None) in POSITIONS_FROM_MASK

        self.windows = attention_windows(model)  # attention kind -> window (None: full)
        self.sliding = any(window is not None for window in self.windows.values())
        self.lean = lean_forward(model) if not self.sliding else None  # transformers' forward where None
        self.reset(1)

    # ------------------------------------------------------------ state

    def reset(self, batch: int) -> None:
        if batch > 1 and not self.batches:
            raise ValueError(
                f"{self.name}: {self.model.config.model_type} models place tokens by cache slot, not by position, "
                "so the gaps of a batch would shift them; pass one prompt at a time"
            )
        # Sliding layers keep every state here (the mask applies the window): a rollback needs them.
        self.cache = DynamicCache() if self.sliding else DynamicCache(config=self.model.config)
        self.slot_pos = torch.empty(batch, 0, dtype=torch.long)  # [batch, slots] on the CPU, -1: hole
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [batch] on the CPU
        self._tree_start: int | None = None  # first slot of the last tree forward, until keep_path

    @property
    def num_slots(self) -> int:
        return self.slot_pos.shape[1]

    # ------------------------------------------------------------ forward

    def feed(
        self,
        sequences: Sequence[Sequence[int]],
        active: torch.Tensor,  # [batch] bool: rows that take part
        extra: torch.Tensor | None = None,  # [batch, n] tokens after the pending ones (drafts)
        extra_valid: torch.Tensor | None = None,  # [batch, n] bool
        keep_logits: int = 1,
        extra_parents: torch.Tensor | None = None,  # [batch, n]: a draft tree (None: a chain)
    ) -> torch.Tensor:
        """Feed each active row's pending tokens (left-padded), then `extra`.
        With `extra_parents`, `extra` is a draft tree: extra_parents[b, j] is the column of extra j's
        parent, or -1 for a child of the last pending token (see `forward`).
        Returns the logits of the last `keep_logits` columns: [batch, keep_logits, vocab].
        Column -(n+1) is each row's next-token law after its committed tokens.
        Ids this model cannot embed (a larger target vocabulary seen by a draft) are fed as PAD_ID:
        a draft's context changes, never its reported law, so verification stays exact."""
        active = active.cpu()
        ids, valid = self.pending(sequences, active)
        width = ids.shape[1]
        ids = to_device(ids, self.device)
        if extra is not None:  # drafts may still be on the device (read with the round's verify result)
            ids = torch.cat([ids, to_device(extra, self.device)], 1)
            valid = torch.cat([valid, extra_valid.cpu() & active[:, None]], 1)
        if extra_parents is None:
            return self.forward(ids, valid, keep_logits)
        pending_parents = torch.arange(-1, width - 1).expand(len(valid), width)  # a chain
        extra_parents = extra_parents.cpu()
        parents = torch.cat([pending_parents, torch.where(extra_parents < 0, width - 1, extra_parents + width)], 1)
        return self.forward(ids, valid, keep_logits, parents=parents)

    def pending(self, sequences: Sequence[Sequence[int]], active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each active row's pending tokens, left-padded: ids and valid [batch, width >= 1], on the CPU."""
        pending = [
            [t if t < self.embed_size else PAD_ID for t in seq[int(length) :]] if on else []
            for seq, length, on in zip(sequences, self.lengths.tolist(), active.cpu().tolist())
        ]
        width = max(1, max(len(p) for p in pending))
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in pending], dtype=torch.long)
        valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in pending], dtype=torch.bool)
        return ids, valid

    def forward(
        self, ids: torch.Tensor, valid: torch.Tensor, keep_logits: int = 1, parents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append ids [batch, n] as n new slots; `valid` [batch, n] marks real tokens.
        parents [batch, n] (None: a chain) makes the new columns a tree: column j attends to the
        cache and to its ancestors (parents[b, j] < j, -1: none among the new columns), and its
        position is its depth. Siblings then share a position, so `keep_path` must pick one path
        before the next rollback.
        `valid` and `parents` are read on the host (pass them from the CPU: a device tensor costs a sync)."""
        valid = valid.cpu()
        if parents is None:
            positions = self.lengths[:, None] + valid.long().cumsum(1) - 1  # [batch, n]
            attention = None
        else:
            seen = tree_ancestors(parents.cpu()) & valid[:, None, :]  # [batch, n, n]: what each column attends
            positions = self.lengths[:, None] + seen.sum(-1) - 1
            attention = seen | torch.eye(ids.shape[1], dtype=torch.bool)
        positions = positions.clamp_min(0)
        check_context(self, positions)
        mask = torch.cat([self.slot_pos >= 0, valid], 1).long()
        if self.sliding:
            new = attention if attention is not None else torch.ones(ids.shape[1], ids.shape[1]).tril().bool()
            mask = self._attention_masks(new & valid[:, None, :] | torch.eye(ids.shape[1], dtype=torch.bool), positions)
        elif attention is not None:
            mask = self._tree_mask(attention)
        elif bool(mask.all()):  # no holes, no padding: the causal mask alone (transformers reads the device to see it)
            mask = None
        ids, at = to_device(ids, self.device), to_device(positions, self.device)
        with torch.inference_mode():
            if self.lean is not None and self.lean.runs():  # the same logits, without transformers' plumbing
                logits = self.lean(ids, mask, at, self.cache, keep_logits)
            else:
                logits = self._transformers_forward(ids, mask, at, keep_logits)
        self.slot_pos = torch.cat([self.slot_pos, torch.where(valid, positions, -1)], 1)
        # A tree's length counts its deepest node (siblings share positions) until keep_path.
        self.lengths = self.lengths + valid.sum(1) if parents is None else self.slot_pos.amax(1) + 1
        self._tree_start = self.num_slots - ids.shape[1] if parents is not None else None
        return logits[:, -keep_logits:].to(self.device)

    def _transformers_forward(self, ids, mask, positions, keep_logits: int) -> torch.Tensor:
        if isinstance(mask, dict):
            mask = {kind: to_device(kind_mask, self.device) for kind, kind_mask in mask.items()}
        elif mask is not None:
            mask = to_device(mask, self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep_logits,
            **{self._cache_kw: self.cache},
        )
        return out.logits

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the batch, in this order (finished rows leave the forwards), and
        drop the slots no remaining row uses: one copy of the cache."""
        rows = rows.cpu()
        slot_pos = self.slot_pos[rows]
        used = (slot_pos >= 0).any(0).nonzero().flatten()
        with torch.inference_mode():  # the cache tensors are inference tensors
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:  # empty ones too: rows
                    on = layer.keys.device  # each layer on its own device (device_map)
                    pick_rows, pick_slots = to_device(rows, on), to_device(used, on)
                    layer.keys = layer.keys.index_select(0, pick_rows).index_select(2, pick_slots)
                    layer.values = layer.values.index_select(0, pick_rows).index_select(2, pick_slots)
        self.slot_pos, self.lengths = slot_pos[:, used], self.lengths[rows]

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (no tokens in the cache: their prompts are pending, fed with the next
        forward beside the other rows' tokens). A new request joins a running batch so."""
        if count and not self.batches and len(self.lengths) + count > 1:
            self.reset(len(self.lengths) + count)  # refuses batches by name (slot-placed families)
        with torch.inference_mode():  # the cache tensors are inference tensors
            for layer in self.cache.layers:
                if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:  # [batch, heads, slots, dim]
                    for name in ("keys", "values"):
                        block = getattr(layer, name)
                        empty = block.new_zeros((count, *block.shape[1:]))
                        setattr(layer, name, torch.cat([block, empty]))
        holes = torch.full((count, self.num_slots), -1, dtype=torch.long)
        self.slot_pos = torch.cat([self.slot_pos, holes])
        self.lengths = torch.cat([self.lengths, torch.zeros(count, dtype=torch.long)])

    def _mask_dtype(self) -> torch.dtype:
        """The dtype of an additive attention mask: the embeddings' (float32 for quantised ones)."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return dtype if dtype.is_floating_point else torch.float32

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool [batch, n, keys] -> additive float mask [batch, 1, n, keys] (0: attend, dtype min: not),
        which transformers passes to the attention as it is."""
        dtype = self._mask_dtype()
        return torch.zeros(allowed[:, None].shape, dtype=dtype).masked_fill_(~allowed[:, None], torch.finfo(dtype).min)

    def _allowed(self, new: torch.Tensor) -> torch.Tensor:
        """What each new column sees [batch, n, slots + n]: the cache's real slots, then `new` [batch, n, n]."""
        past = (self.slot_pos >= 0)[:, None, :].expand(-1, new.shape[1], -1)
        return torch.cat([past, new.expand(len(past), -1, -1)], 2)

    def _tree_mask(self, attention: torch.Tensor) -> torch.Tensor:
        """The mask of a tree forward: the cache's real slots, then the tree's ancestors (built on the host)."""
        return self._additive(self._allowed(attention))

    def _attention_masks(self, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict:
        """Masks for a model with sliding-window layers: `new` [batch, n, n] as in `_allowed`, and each
        kind's window applied in positions (a key is seen while query position - key position < window,
        as transformers' sliding mask counts). One mask per kind, a dict where the kinds differ."""
        allowed = self._allowed(new)
        key_pos = torch.cat([self.slot_pos, positions], 1)  # [batch, slots + n]
        distance = positions[:, :, None] - key_pos[:, None, :]  # [batch, n, slots + n]
        masks = {
            kind: self._additive(allowed if window is None else allowed & (distance < window))
            for kind, window in self.windows.items()
        }
        return masks if len(masks) > 1 else next(iter(masks.values()))

    def keep_path(self, keep: torch.Tensor) -> None:
        """After a tree forward: keep [batch, n] bool marks, per row, the tree's nodes (the `extra`
        columns of `feed`) on its chosen path. They move, in order and after the pending tokens, to
        the front of the forward's slots; the rest become holes, which the next rollback crops.
        Afterwards the cache is a chain again."""
        start = self._tree_start
        assert start is not None, "keep_path follows a tree forward"
        pending = self.num_slots - start - keep.shape[1]
        keep = torch.cat([self.slot_pos[:, start : start + pending] >= 0, keep.cpu()], 1)
        order = torch.sort((~keep).long(), dim=1, stable=True).indices  # kept columns first, in order
        with torch.inference_mode():  # the cache tensors are inference tensors
            for layer in self.cache.layers:
                index = to_device(order, layer.keys.device)[:, None, :, None]
                for name in ("keys", "values"):
                    block = getattr(layer, name)[:, :, start:]
                    block.copy_(block.gather(2, index.expand_as(block)))
        kept = torch.where(keep, self.slot_pos[:, start:], -1).gather(1, order)
        self.slot_pos = torch.cat([self.slot_pos[:, :start], kept], 1)
        self.lengths = self.slot_pos.amax(1) + 1
        self._tree_start = None

    # ------------------------------------------------------------ rollback

    def commit(self, keep_len: torch.Tensor, path: torch.Tensor | None = None) -> None:
        """After a round: keep the tree's path (None after a chain), then at most keep_len[b] tokens per row."""
        if path is not None:
            self.keep_path(path)
        self.rollback(torch.minimum(self.lengths, keep_len.cpu()))

    def rollback(self, keep_len: torch.Tensor) -> None:
        """Keep the first keep_len[b] real tokens of each row (absolute lengths)."""
        keep_len = keep_len.cpu()
        assert bool((keep_len <= self.lengths).all()), "rollback cannot grow the cache"
        self.slot_pos = torch.where(self.slot_pos < keep_len[:, None], self.slot_pos, -1)
        self.lengths = keep_len.clone()
        used = (self.slot_pos >= 0).any(0).nonzero()
        new_slots = int(used.max()) + 1 if used.numel() else 0
        if new_slots < self.num_slots:
            self.cache.crop(new_slots - self.num_slots)  # 5.x: a negative count of slots to drop
            self.slot_pos = self.slot_pos[:, :new_slots]
        assert self.cache.get_seq_length() == self.num_slots


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [batch, n] (parents[b, j] < j, -1: a root) -> [batch, n, n] bool: column j's
    ancestors and itself (row j of the matrix)."""
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    seen = eye.expand(batch, n, n).clone()
    rows = torch.arange(batch, device=parents.device)
    for j in range(n):  # topological order: a parent's row is complete before its children's
        parent = parents[:, j]
        has = parent >= 0
        seen[:, j] |= seen[rows, parent.clamp_min(0)] & has[:, None]
    return seen


def check_context(model, positions: torch.Tensor) -> None:
    """Refuse positions [batch, n] (on the host) past the model's context."""
    if model.max_positions and positions.numel() and int(positions.max()) >= model.max_positions:
        raise ValueError(
            f"{model.name}: sequence of {int(positions.max()) + 1} tokens exceeds the model's context of "
            f"{model.max_positions}; shorten the prompt or lower max_new_tokens"
        )
