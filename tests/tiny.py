"""Tiny random models with the real tokenizers: cheap, deterministic loops on CPU."""

from __future__ import annotations

import random
from typing import Any

import torch

from uag.api import Pair, make_pair
from uag.kernels.choice import ROWWISE_MAX_ROWS
from uag.runtime.models import wrap_model


def one_clean_line(capsys) -> str:
    """The captured stderr, asserted to be one line with no traceback (how bad input must fail)."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def logits_after_crop_and_fresh(model, ids: list[int], rejected: list[int], next_id: int):
    """(``model``: a Transformers model, or a ``CachedLM`` to run twins of.) Logits for ``next_id`` after feeding ``rejected`` and cropping it away, and from a fresh
    prefill of the same sequence: a correct rollback makes them equal."""
    from uag.runtime.runner import CachedLM

    make = model.twin if isinstance(model, CachedLM) else lambda: CachedLM(model)
    lm = make()
    lm.reset(ids, rollback=True)
    lm.forward()
    lm.ids.extend(rejected)
    lm.forward()
    lm.truncate(len(ids))
    lm.ids.append(next_id)
    after = lm.logits(lm.forward()[-1:])
    fresh = make()
    fresh.reset([*ids, next_id], rollback=False)
    return after, fresh.logits(fresh.forward()[-1:])


def feed_both_and_compare(
    a, b, ids: list[int], *, prefill: int, chunks, reject: int, tol: float
) -> None:
    """Feed ``ids`` to two ``CachedLM``s (same model, different forwards) after a ``prefill``,
    in ``chunks``, asserting equal logits within ``tol``; after the 9-row chunk both roll back
    ``reject`` positions, as a verify rejecting a draft does."""
    for lm in (a, b):
        lm.reset(ids[:prefill], rollback=True)
    pos = prefill
    for chunk in chunks:
        outs = []
        for lm in (a, b):
            lm.ids.extend(ids[pos : pos + chunk])
            outs.append(lm.logits(lm.forward()))
        torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
        pos += chunk
        if chunk == 9:
            for lm in (a, b):
                lm.truncate(pos - reject)
            pos -= reject


def one_row_vs_chunked_logits(lm, prompt: list[int], tokens: list[int], seed: int = 0):
    """Logits for every token fed one per forward (target-alone) and in random chunks of
    1–``ROWWISE_MAX_ROWS`` (every verify size the loop sends): a row-count-invariant forward
    makes them bitwise equal."""
    lm.reset(prompt, rollback=False)
    lm.forward()
    alone = []
    for tok in tokens:
        lm.ids.append(tok)
        alone.append(lm.greedy(lm.forward()[-1:]).logits[0])
    rng = random.Random(seed)
    lm.reset(prompt, rollback=True)
    lm.forward()
    chunked, i = [], 0
    while i < len(tokens):
        k = rng.randint(1, ROWWISE_MAX_ROWS)
        lm.ids.extend(tokens[i : i + k])
        chunked.append(lm.greedy(lm.forward()).logits)
        i += k
    return torch.stack(alone), torch.cat(chunked)


def integer_products_excess(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, block: int
) -> float:
    """How far ``exact.c``'s products ``y`` of ``x @ w.T + b`` stray beyond what its activation
    grid allows, in float roundings of sum |x||w|: the largest of
    (|y - exact| - 2^-14 sum_b max|x_b| sum_(k in b) |w_k|) / (2^-24 sum |x||w|) (every value
    of x is within 2^-15 of its block's grid step, 2^-14 of the block's largest; the rest is
    float rounding). The grid term is a worst case (every rounding the same way), so the
    kernel measures far below 0 (~-2,500 on random blocks); a wrong block exponent or a
    dropped byte is tens of thousands of units over. The grid itself is tested exactly in
    tests/test_kernels.py (a diagonal weight)."""
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.T + (b.double() if b is not None else 0.0)
    scale = x64.abs() @ w64.abs().T + (b.double().abs() if b is not None else 0.0)
    blocks = x64.shape[-1] // block
    top = x64.abs().reshape(*x64.shape[:-1], blocks, block).amax(-1)  # [rows, blocks]
    wsum = w64.abs().reshape(w64.shape[0], blocks, block).sum(-1)  # [out, blocks]
    grid = 2.0**-14 * (top @ wsum.T)
    return (((y.double() - exact).abs() - grid) / (2.0**-24 * scale)).max().item()


def tiny_gemma(vocab: int, *, seed: int = 0, sliding_window: int = 8):
    """A 2-layer Gemma 3 with a tiny sliding window, so crops past the window happen early."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Gemma3ForCausalLM(config).float()


def q8_0_like(out: int, width: int, *, steps: int, top: float, generator: torch.Generator):
    """``[out, width]`` as GGUF's Q8_0 (``steps`` 127) or Q5_0 (16) de-quantises: per block of
    32, an fp16 scale (below ``top`` + 1e-4) times integers whose largest magnitude is
    ``steps``."""
    q = torch.randint(-steps, steps + 1, (out, width), generator=generator).float()
    q[:, ::32] = -float(steps)
    scales = (torch.rand(out, width // 32, generator=generator) * top + 1e-4).half().float()
    return q * scales.repeat_interleave(32, dim=1)


def q4_k_like(q: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:
    """Integers ``q`` (0..15) as GGUF's Q4_K de-quantises them: per block of 32, an exact scale
    times ``q`` minus an exact minimum (each an fp16 times a 6-bit integer)."""
    out, width = q.shape

    def exact(top: float) -> torch.Tensor:
        d = (torch.rand(out, width // 32, generator=generator) * top / 63).half().float()
        d = d * torch.randint(16, 64, (out, width // 32), generator=generator).float()
        return d.repeat_interleave(32, 1)

    return q * exact(2e-3) - exact(0.02)


def gguf_like_gemma(vocab: int, *, seed: int = 0):
    """``tiny_gemma`` whose layers' weights are as Gemma 3's GGUF de-quantises them: q/k/v and
    gate/up Q8_0-like, o and down Q4_K-like, so uag's native kernels hold them as exact blocks
    and its lean body moves them to ``exact.c``."""
    return gguf_like(tiny_gemma(vocab, seed=seed), seed=seed)


def tiny_qwen2(vocab: int, *, seed: int = 2, tied: bool = False):
    """A random Qwen2 decoder (Qwen2.5's structure: q/k/v with biases, GQA, rope base 1e6; the
    head ``tied`` to the embedding as in the 0.5B, or its own as in the 1.5B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # biases as large as a trained model's, so a kernel that drops one fails
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                linear.bias.normal_(0.0, 0.5)
    return model


def gguf_like(model: Any, *, seed: int = 0) -> Any:
    """``model`` with its layers' weights as a GGUF de-quantises them: q/k/v and gate/up
    Q8_0-like, o and down Q4_K-like, so uag's native kernels hold them as exact blocks and its
    lean body moves them to ``exact.c``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                out, width = linear.weight.shape
                linear.weight.copy_(q8_0_like(out, width, steps=127, top=4e-4, generator=gen))
            for linear in (attn.o_proj, mlp.down_proj):
                q = torch.randint(0, 16, tuple(linear.weight.shape), generator=gen).float()
                linear.weight.copy_(q4_k_like(q, generator=gen))
    return model


def gguf_like_pair(tokenizers, *, kernels: str = "auto", family: str = "gemma3") -> Pair:
    """A GGUF-like target (``gguf_like_gemma``, or ``family`` ``qwen2``: ``tiny_qwen2``'s
    layers as ``gguf_like``) ← a noisy copy of it (same tokenizer): many acceptances."""
    gemma_tok, _ = tokenizers
    if family == "qwen2":
        model = gguf_like(tiny_qwen2(len(gemma_tok)))
    else:
        model = gguf_like_gemma(len(gemma_tok))
    target = wrap_model(model, gemma_tok, ref=f"tiny-{family}-gguf")
    noisy = noisy_copy(model, scale=0.05)
    assistant = wrap_model(noisy, gemma_tok, ref=f"tiny-{family}-gguf-noisy")
    return make_pair(target, assistant, kernels=kernels)


def tiny_llama(vocab: int, *, seed: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).float()


def noisy_copy(model, *, scale: float, seed: int = 7):
    """The same model with Gaussian noise on every weight: an assistant that agrees often."""
    import copy

    torch.manual_seed(seed)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    return clone


def cross_pair(tokenizers, *, kernels: str = "auto") -> Pair:
    """Tiny Gemma target ← tiny Llama assistant: different tokenizers, mostly rejections."""
    gemma_tok, smol_tok = tokenizers
    target = wrap_model(tiny_gemma(len(gemma_tok)), gemma_tok, ref="tiny-gemma")
    assistant = wrap_model(tiny_llama(len(smol_tok)), smol_tok, ref="tiny-llama")
    return make_pair(target, assistant, kernels=kernels)


def same_tokenizer_pair(
    tokenizers, *, noise: float, kernels: str = "auto", draft_vocab: int | None = 0
) -> Pair:
    """Tiny Gemma target ← a noisy copy of itself: many acceptances, some rejections. It drafts
    from every id by default, so what it gets accepted is down to the noise alone (a random
    model's choices ignore ``uag.runtime.draft_vocab``'s frequency order)."""
    gemma_tok, _ = tokenizers
    model = tiny_gemma(len(gemma_tok))
    target = wrap_model(model, gemma_tok, ref="tiny-gemma")
    assistant = wrap_model(noisy_copy(model, scale=noise), gemma_tok, ref="tiny-gemma-noisy")
    return make_pair(target, assistant, kernels=kernels, draft_vocab=draft_vocab)


def write_tiny_gguf(path, *, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A random 2-layer Llama as a ``.gguf`` file with SmolLM2's tokenizer (copied from the
    embedded GGUF): what ``uag models prepare`` and ``--target x.gguf`` convert, in seconds
    instead of the real models' minute. Weights in Q8_0, ~4 MB (the 49,152-row embedding)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    from uag.runtime.models import EMBEDDED, embedded_gguf_path

    source = GGUFReader(embedded_gguf_path(EMBEDDED["smollm2-135m"]))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    heads, kv_heads, head_dim = 2, 1, hidden // 2
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub)
    rng = np.random.default_rng(seed)

    def add_q8_0(name: str, *shape: int) -> None:
        """Random weights stored as GGUF's Q8_0, as real GGUF files store theirs: de-quantised,
        they are the exact blocks the native kernels and a prepared target's head take."""
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        packed = quants.quantize(data, GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    add_q8_0("token_embd.weight", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for name, shape in (
            ("attn_q", (heads * head_dim, hidden)),
            ("attn_k", (kv_heads * head_dim, hidden)),
            ("attn_v", (kv_heads * head_dim, hidden)),
            ("attn_output", (hidden, heads * head_dim)),
            ("ffn_gate", (2 * hidden, hidden)),
            ("ffn_up", (2 * hidden, hidden)),
            ("ffn_down", (hidden, 2 * hidden)),
        ):
            add_q8_0(f"blk.{i}.{name}.weight", *shape)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
