"""A tiny decoder-only transformer with a paged KV cache, and its dense reference.

The model is deliberately small and plain: grouped-query attention, RMSNorm, rotary position
embeddings, a SwiGLU MLP, float32 everywhere. Its weights are drawn from a seeded generator on
the CPU, so every process that builds ``TinyLM(ModelConfig(seed=s))`` holds bit-identical
weights: a prefill engine and a decode engine agree on the KV cache without sharing a file.

Two forward passes share the same layer math:

- :meth:`TinyLM.forward_paged` — the engine's pass. New tokens of many requests are packed into
  one flat batch; each layer writes their K/V into the paged cache through a slot mapping and
  reads each request's whole context back through its block table. Connector hooks run around
  each layer's attention (:class:`AttentionHooks`).
- :meth:`TinyLM.forward_dense` — the reference: one sequence, no cache, K/V computed for every
  position at once. Tests check the paged engine against it token for token.

**Tensor parallelism.** ``TinyLM(config, shard=TPShard(rank=r, size=n), all_reduce=...)`` is
rank ``r``'s shard of the model, as in Megatron-LM and vLLM: the query heads, the KV heads
(:meth:`TPShard.kv_heads`; replicated when ``n`` exceeds the KV-head count) and the MLP's
intermediate columns are split across ranks (``wq``, ``wk``, ``wv``, ``w_gate``, ``w_up``
column-parallel; ``wo`` and ``w_down`` row-parallel), and the two row-parallel products of each
layer are summed over the ranks by ``all_reduce``. The embedding, the norms and the LM head are
replicated. Every rank generates the whole model from the seed and keeps its slices, so a
shard's weights are bit-identical to the same slices of the unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

__all__ = [
    "AttentionHooks",
    "ModelConfig",
    "PagedBatch",
    "SeqSlice",
    "TPShard",
    "TinyLM",
    "check_tp_size",
    "greedy_reference",
]


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{attribute.name} = {value!r}; it must be a positive int")


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The model's shape and its weight seed. Equal configs build bit-identical models.

    Raises ``ValueError`` at construction when a size is not a positive int, when
    ``num_heads`` is not a multiple of ``num_kv_heads`` (grouped-query attention shares each
    KV head among ``num_heads // num_kv_heads`` query heads) or when ``head_dim`` is odd
    (rotary embeddings rotate pairs of dimensions).
    """

    vocab_size: int = attrs.field(default=512, validator=_positive)
    num_layers: int = attrs.field(default=4, validator=_positive)
    num_heads: int = attrs.field(default=8, validator=_positive)
    num_kv_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=32, validator=_positive)
    intermediate_size: int = attrs.field(default=512, validator=_positive)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    """Seed of the weight generator; P and D must use the same seed (and shape)."""

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig: num_heads = {self.num_heads} is not a multiple of "
                f"num_kv_heads = {self.num_kv_heads}; pick num_kv_heads dividing num_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ModelConfig.head_dim = {self.head_dim}; rotary embeddings need an even head_dim"
            )

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim


def check_tp_size(config: ModelConfig, tp_size: object) -> int:
    """Return ``tp_size`` if ``config`` can be split over that many ranks, else raise
    ``ValueError`` naming what does not divide and the sizes that would work.

    A size works when it divides ``num_heads`` and ``intermediate_size``, and either divides
    ``num_kv_heads`` (each rank holds ``num_kv_heads // tp_size`` KV heads) or is a multiple
    of it (each KV head is replicated on ``tp_size // num_kv_heads`` ranks, as vLLM does).
    """
    c = config
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size = {tp_size!r}; it must be a positive int")
    ok = [n for n in range(1, c.num_heads + 1) if not _tp_problems(c, n)]
    problems = _tp_problems(c, tp_size)
    if problems:
        raise ValueError(
            f"tp_size = {tp_size} does not fit the model: {'; '.join(problems)}; "
            f"tensor-parallel sizes that fit this model: {ok}"
        )
    return tp_size


def _tp_problems(c: ModelConfig, n: int) -> list[str]:
    problems = []
    if c.num_heads % n:
        problems.append(f"it does not divide num_heads = {c.num_heads}")
    if c.num_kv_heads % n and n % c.num_kv_heads:
        problems.append(
            f"it neither divides num_kv_heads = {c.num_kv_heads} nor is a multiple of it "
            "(KV heads are split across ranks, or replicated when there are fewer than ranks)"
        )
    if c.intermediate_size % n:
        problems.append(f"it does not divide intermediate_size = {c.intermediate_size}")
    return problems


@attrs.frozen(kw_only=True)
class TPShard:
    """Which tensor-parallel rank a :class:`TinyLM` is: rank ``rank`` of ``size``.

    The default is the whole model (rank 0 of 1). Raises ``ValueError`` for a rank outside
    ``0 .. size - 1``; whether ``size`` fits a model is :func:`check_tp_size`'s job.
    """

    rank: int = 0
    size: int = 1

    def __attrs_post_init__(self) -> None:
        if type(self.size) is not int or self.size < 1:
            raise ValueError(f"TPShard.size = {self.size!r}; it must be a positive int")
        if type(self.rank) is not int or not 0 <= self.rank < self.size:
            raise ValueError(f"TPShard.rank = {self.rank!r}; it must lie in 0..{self.size - 1}")

    def heads(self, c: ModelConfig) -> range:
        """The query heads this rank computes (a contiguous ``num_heads // size``)."""
        n = c.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, c: ModelConfig) -> range:
        """The KV heads this rank holds in its cache: ``num_kv_heads // size`` of them, or,
        when ``size`` exceeds ``num_kv_heads``, the one head its query heads use (rank ``r``
        holds head ``r // (size // num_kv_heads)``: each head on that many ranks)."""
        if self.size <= c.num_kv_heads:
            n = c.num_kv_heads // self.size
            return range(self.rank * n, (self.rank + 1) * n)
        head = self.rank // (self.size // c.num_kv_heads)
        return range(head, head + 1)

    def intermediate(self, c: ModelConfig) -> range:
        """The MLP intermediate columns this rank computes."""
        n = c.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)


def _rows(t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return t[heads.start * head_dim : heads.stop * head_dim].contiguous()


class AttentionHooks(Protocol):
    """Called by :meth:`TinyLM.forward_paged` around each layer's attention.

    The model runner implements it by forwarding to the connector's worker side; this is the
    only way connector code runs inside the forward pass.
    """

    def before_attention(self, layer: int) -> None:
        """Called before layer ``layer`` writes or reads its KV cache (a layer-wise load must
        have landed by the time this returns)."""

    def after_attention(self, layer: int) -> None:
        """Called after layer ``layer``'s attention: the new tokens' K/V are in its cache."""


@attrs.frozen(kw_only=True)
class SeqSlice:
    """One request's part of a :class:`PagedBatch`."""

    start: int
    """Index of its first new token in the flat batch."""
    end: int
    """One past its last new token in the flat batch."""
    context_len: int
    """Tokens of this request in the cache once this step's tokens are written."""
    block_table: torch.Tensor
    """Its block ids in token order (int64, on the model's device), covering ``context_len``."""


@attrs.frozen(kw_only=True)
class PagedBatch:
    """The flat input of one paged forward pass (built by the model runner).

    ``token_ids``, ``positions`` and ``slot_mapping`` are int64 tensors of one length (the
    number of new tokens in the step); slot ``s`` is token offset ``s % block_size`` of block
    ``s // block_size``.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seqs: tuple[SeqSlice, ...]


class TinyLM:
    """The model: weights plus the two forward passes. Not an ``nn.Module`` — it never trains.

    Args:
        config: the shape and seed.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; weights are generated on the CPU and
            then moved, so every device sees the same values.
        shard: which tensor-parallel rank this is (default: the whole model); the size must
            pass :func:`check_tp_size` (``ValueError`` otherwise).
        all_reduce: sums a tensor over the ranks (in place or not; the result is used), called
            twice per layer in every forward pass, by every rank in the same order. Required
            when ``shard.size > 1`` (``ValueError`` otherwise); unused with one rank.
    """

    def __init__(
        self,
        config: ModelConfig,
        device: str | torch.device = "cpu",
        *,
        shard: TPShard | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.shard = shard = shard if shard is not None else TPShard()
        check_tp_size(config, shard.size)
        if shard.size > 1 and all_reduce is None:
            raise ValueError(
                f"TinyLM: shard {shard.rank} of {shard.size} needs all_reduce (a sum over the "
                "ranks, e.g. torch.distributed.all_reduce)"
            )
        self._all_reduce = all_reduce if shard.size > 1 else None
        gen = torch.Generator().manual_seed(config.seed)
        c = config
        heads, kv_heads, inter = shard.heads(c), shard.kv_heads(c), shard.intermediate(c)
        self.num_heads = len(heads)
        """Query heads of this shard (all of them with one rank)."""
        self.num_kv_heads = len(kv_heads)
        """KV heads of this shard, the heads its KV cache holds."""

        def w(*shape: int) -> torch.Tensor:
            # Scaled so activations stay O(1) through the layers: greedy decoding then depends
            # on the prompt instead of collapsing onto one token. Every rank draws the whole
            # matrix (the generator's sequence is the model's) and keeps its slice.
            return torch.randn(*shape, generator=gen, dtype=torch.float32) / math.sqrt(shape[-1])

        self.embed = (torch.randn(c.vocab_size, c.hidden_size, generator=gen)).to(self.device)
        self.layers: list[dict[str, torch.Tensor]] = []
        d = c.head_dim
        for _ in range(c.num_layers):
            wq = w(c.num_heads * d, c.hidden_size)
            wk = w(c.num_kv_heads * d, c.hidden_size)
            wv = w(c.num_kv_heads * d, c.hidden_size)
            wo = w(c.hidden_size, c.num_heads * d)
            w_gate = w(c.intermediate_size, c.hidden_size)
            w_up = w(c.intermediate_size, c.hidden_size)
            w_down = w(c.hidden_size, c.intermediate_size)
            layer = {
                "attn_norm": torch.ones(c.hidden_size),
                "wq": _rows(wq, heads, d),
                "wk": _rows(wk, kv_heads, d),
                "wv": _rows(wv, kv_heads, d),
                "wo": _rows(wo.T, heads, d).T.contiguous(),
                "mlp_norm": torch.ones(c.hidden_size),
                "w_gate": _rows(w_gate, inter, 1),
                "w_up": _rows(w_up, inter, 1),
                "w_down": _rows(w_down.T, inter, 1).T.contiguous(),
            }
            self.layers.append({k: v.to(self.device) for k, v in layer.items()})
        self.final_norm = torch.ones(c.hidden_size, device=self.device)
        self.lm_head = w(c.vocab_size, c.hidden_size).to(self.device)
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, half, dtype=torch.float32, device=self.device) / half)
        )

    # -- shared layer math ------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(dim=-1, keepdim=True)
        return x * torch.rsqrt(var + self.config.rms_eps) * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[T, heads, head_dim]`` by each token's position."""
        angles = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]
        cos = angles.cos()[:, None, :]
        sin = angles.sin()[:, None, :]
        half = self.config.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def _qkv(
        self, h: torch.Tensor, layer: dict[str, torch.Tensor], positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.config.head_dim
        x = self._rms_norm(h, layer["attn_norm"])
        q = (x @ layer["wq"].T).view(-1, self.num_heads, d)
        k = (x @ layer["wk"].T).view(-1, self.num_kv_heads, d)
        v = (x @ layer["wv"].T).view(-1, self.num_kv_heads, d)
        return self._rope(q, positions), self._rope(k, positions), v

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        # The row-parallel products' sum over the ranks (nothing to add with one rank).
        return partial if self._all_reduce is None else self._all_reduce(partial)

    def _attend(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of queries at ``q_pos`` over keys at positions ``0..len(k)-1``.

        ``q`` is ``[n, heads, d]``; ``k`` and ``v`` are ``[ctx, kv_heads, d]`` (this shard's
        heads). Returns ``[n, heads * d]``.
        """
        c = self.config
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        k_pos = torch.arange(k.shape[0], device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return out.reshape(q.shape[0], self.num_heads * c.head_dim)

    def _mlp(self, h: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self._rms_norm(h, layer["mlp_norm"])
        gated = torch.nn.functional.silu(x @ layer["w_gate"].T) * (x @ layer["w_up"].T)
        return self._reduce(gated @ layer["w_down"].T)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h, self.final_norm) @ self.lm_head.T

    # -- the engine's pass -----------------------------------------------------------------
    def kv_cache_shape(
        self, num_blocks: int, block_size: int, order: str = "NHD"
    ) -> tuple[int, ...]:
        """Shape of one layer's cache: ``[num_blocks, 2, block_size, kv_heads, head_dim]``
        (``order`` ``"NHD"``, tokens then heads) or ``[num_blocks, 2, kv_heads, block_size,
        head_dim]`` (``"HND"``, heads then tokens), ``kv_heads`` being this shard's
        (:attr:`num_kv_heads`). Raises ``ValueError`` for another order.

        Block-major, K at index 0 and V at index 1 of dimension 1: one block id names the same
        tokens in every layer, and one block of one layer is one contiguous byte range (what a
        transport moves).
        """
        if order == "NHD":
            return (num_blocks, 2, block_size, self.num_kv_heads, self.config.head_dim)
        if order == "HND":
            return (num_blocks, 2, self.num_kv_heads, block_size, self.config.head_dim)
        raise ValueError(f"KV cache order {order!r}; it must be 'NHD' or 'HND'")

    @torch.inference_mode()
    def forward_paged(
        self,
        batch: PagedBatch,
        kv_caches: Sequence[torch.Tensor],
        hooks: AttentionHooks | None = None,
        *,
        order: str = "NHD",
    ) -> torch.Tensor:
        """Run the new tokens of every request in ``batch`` through the model.

        ``kv_caches`` are in ``order`` (:meth:`kv_cache_shape`): the K/V written and read go
        through that order's dimensions.

        Each layer calls ``hooks.before_attention(layer)``, writes the new tokens' K/V at
        ``batch.slot_mapping``, lets each request attend over its ``context_len`` cached tokens
        read through its block table, then calls ``hooks.after_attention(layer)``.

        Returns the logits of each request's *last* new token, ``[len(batch.seqs), vocab]``.
        Raises ``ValueError`` when ``kv_caches`` does not hold one tensor per layer. If a hook
        raises, the cache holds whatever layers were written before it.
        """
        c = self.config
        if len(kv_caches) != c.num_layers:
            raise ValueError(
                f"got {len(kv_caches)} KV cache tensors for a {c.num_layers}-layer model; "
                "pass one tensor per layer (see kv_cache_shape)"
            )
        if order not in ("NHD", "HND"):
            raise ValueError(f"KV cache order {order!r}; it must be 'NHD' or 'HND'")
        nhd = order == "NHD"
        block_size = kv_caches[0].shape[2 if nhd else 3]
        blk = torch.div(batch.slot_mapping, block_size, rounding_mode="floor")
        off = batch.slot_mapping % block_size
        h = self.embed[batch.token_ids]
        for i, layer in enumerate(self.layers):
            cache = kv_caches[i]
            q, k, v = self._qkv(h, layer, batch.positions)
            if hooks is not None:
                hooks.before_attention(i)
            if nhd:
                cache[blk, 0, off] = k
                cache[blk, 1, off] = v
            else:  # the token's row of every head: [tokens, kv_heads, d] as NHD's
                cache[blk, 0, :, off] = k
                cache[blk, 1, :, off] = v
            outs = []
            for seq in batch.seqs:
                kv = cache[seq.block_table]
                if not nhd:  # [n_blocks, 2, kv_heads, block_size, d] -> NHD's
                    kv = kv.transpose(2, 3)
                # [n_blocks, 2, block_size, kv_heads, d]
                ctx_k = kv[:, 0].reshape(-1, self.num_kv_heads, c.head_dim)[: seq.context_len]
                ctx_v = kv[:, 1].reshape(-1, self.num_kv_heads, c.head_dim)[: seq.context_len]
                outs.append(
                    self._attend(
                        q[seq.start : seq.end], batch.positions[seq.start : seq.end], ctx_k, ctx_v
                    )
                )
            if hooks is not None:
                hooks.after_attention(i)
            h = h + self._reduce(torch.cat(outs) @ layer["wo"].T)
            h = h + self._mlp(h, layer)
        last = torch.tensor([s.end - 1 for s in batch.seqs], device=h.device, dtype=torch.long)
        return self._logits(h[last])

    # -- the reference ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_dense(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits at every position of one sequence, computed without any cache.

        Returns ``[len(token_ids), vocab]``. Raises ``ValueError`` for an empty sequence or a
        token id outside the vocabulary.
        """
        if not token_ids:
            raise ValueError("forward_dense needs at least one token")
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        positions = torch.arange(len(token_ids), device=self.device)
        h = self.embed[ids]
        for layer in self.layers:
            q, k, v = self._qkv(h, layer, positions)
            h = h + self._reduce(self._attend(q, positions, k, v) @ layer["wo"].T)
            h = h + self._mlp(h, layer)
        return self._logits(h)


def greedy_reference(model: TinyLM, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy decoding with :meth:`TinyLM.forward_dense`, recomputing the whole sequence for
    every token: slow, obviously correct, and the oracle for the engine's output.

    Returns the ``max_tokens`` generated token ids. Raises ``ValueError`` for an empty prompt
    or ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}; it must be at least 1")
    seq = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(model.forward_dense(seq)[-1].argmax())
        out.append(nxt)
        seq.append(nxt)
    return out
