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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch

__all__ = [
    "AttentionHooks",
    "ModelConfig",
    "PagedBatch",
    "SeqSlice",
    "TinyLM",
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
    """

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        c = config

        def w(*shape: int) -> torch.Tensor:
            # Scaled so activations stay O(1) through the layers: greedy decoding then depends
            # on the prompt instead of collapsing onto one token.
            t = torch.randn(*shape, generator=gen, dtype=torch.float32) / math.sqrt(shape[-1])
            return t.to(self.device)

        self.embed = (torch.randn(c.vocab_size, c.hidden_size, generator=gen)).to(self.device)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(c.num_layers):
            self.layers.append(
                {
                    "attn_norm": torch.ones(c.hidden_size, device=self.device),
                    "wq": w(c.num_heads * c.head_dim, c.hidden_size),
                    "wk": w(c.num_kv_heads * c.head_dim, c.hidden_size),
                    "wv": w(c.num_kv_heads * c.head_dim, c.hidden_size),
                    "wo": w(c.hidden_size, c.num_heads * c.head_dim),
                    "mlp_norm": torch.ones(c.hidden_size, device=self.device),
                    "w_gate": w(c.intermediate_size, c.hidden_size),
                    "w_up": w(c.intermediate_size, c.hidden_size),
                    "w_down": w(c.hidden_size, c.intermediate_size),
                }
            )
        self.final_norm = torch.ones(c.hidden_size, device=self.device)
        self.lm_head = w(c.vocab_size, c.hidden_size)
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
        c = self.config
        x = self._rms_norm(h, layer["attn_norm"])
        q = (x @ layer["wq"].T).view(-1, c.num_heads, c.head_dim)
        k = (x @ layer["wk"].T).view(-1, c.num_kv_heads, c.head_dim)
        v = (x @ layer["wv"].T).view(-1, c.num_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(
        self,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of queries at ``q_pos`` over keys at positions ``0..len(k)-1``.

        ``q`` is ``[n, heads, d]``; ``k`` and ``v`` are ``[ctx, kv_heads, d]``. Returns
        ``[n, heads * d]``.
        """
        c = self.config
        group = c.num_heads // c.num_kv_heads
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(c.head_dim)
        k_pos = torch.arange(k.shape[0], device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return out.reshape(q.shape[0], c.num_heads * c.head_dim)

    def _mlp(self, h: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self._rms_norm(h, layer["mlp_norm"])
        gated = torch.nn.functional.silu(x @ layer["w_gate"].T) * (x @ layer["w_up"].T)
        return gated @ layer["w_down"].T

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(h, self.final_norm) @ self.lm_head.T

    # -- the engine's pass -----------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.

        Block-major, K at index 0 and V at index 1 of dimension 1: one block id names the same
        tokens in every layer, and one block of one layer is one contiguous byte range (what a
        transport moves).
        """
        c = self.config
        return (num_blocks, 2, block_size, c.num_kv_heads, c.head_dim)

    @torch.inference_mode()
    def forward_paged(
        self,
        batch: PagedBatch,
        kv_caches: Sequence[torch.Tensor],
        hooks: AttentionHooks | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of every request in ``batch`` through the model.

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
        block_size = kv_caches[0].shape[2]
        blk = torch.div(batch.slot_mapping, block_size, rounding_mode="floor")
        off = batch.slot_mapping % block_size
        h = self.embed[batch.token_ids]
        for i, layer in enumerate(self.layers):
            cache = kv_caches[i]
            q, k, v = self._qkv(h, layer, batch.positions)
            if hooks is not None:
                hooks.before_attention(i)
            cache[blk, 0, off] = k
            cache[blk, 1, off] = v
            outs = []
            for seq in batch.seqs:
                kv = cache[seq.block_table]  # [n_blocks, 2, block_size, kv_heads, d]
                ctx_k = kv[:, 0].reshape(-1, c.num_kv_heads, c.head_dim)[: seq.context_len]
                ctx_v = kv[:, 1].reshape(-1, c.num_kv_heads, c.head_dim)[: seq.context_len]
                outs.append(
                    self._attend(
                        q[seq.start : seq.end], batch.positions[seq.start : seq.end], ctx_k, ctx_v
                    )
                )
            if hooks is not None:
                hooks.after_attention(i)
            h = h + torch.cat(outs) @ layer["wo"].T
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
            h = h + self._attend(q, positions, k, v) @ layer["wo"].T
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
