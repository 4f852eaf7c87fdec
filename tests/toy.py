"""Hand-made tokenizers and models with small vocabularies: fast distribution tests.

Two byte-level BPE tokenizers trained on different text (different merges, so different
vocabularies over the same bytes), and a target/assistant pair built so they mostly agree: the
assistant is the target's own network with its vocabulary rows moved to wherever its tokenizer
spells the same bytes (and noise on top), so speculative sampling accepts often and rejects
sometimes, and both paths are exercised.
"""

from __future__ import annotations

from typing import Any

import torch

from uag.api import Pair, make_pair
from uag.runtime.models import wrap_model
from uag.runtime.tokcache import token_bytes_table

from .tiny import noisy_copy, tiny_gemma

_TEXT_A = ["def add(a, b):\n    return a + b\n", "the cat sat on the mat", "print('hi')\r\n"] * 20
_TEXT_B = ["hello world, hello there", "for i in range(10):\n\tx += i", "café 😀 你好"] * 20


def byte_bpe(corpus: list[str], vocab_size: int, *, normalizer: Any = None):
    """A byte-level BPE tokenizer (every byte is a token, plus merges learned from ``corpus``);
    ``normalizer`` (a ``tokenizers.normalizers`` object: Qwen2's is ``NFC()``) runs first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<eos>", "<bos>"],
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )


def toy_tokenizers():
    """(target, assistant): 300 and 280 tokens. The same corpus, so the assistant's merges are
    the target's first ones: different vocabularies and tokenisations over a shared core."""
    return byte_bpe(_TEXT_A + _TEXT_B, 300), byte_bpe(_TEXT_A + _TEXT_B, 280)


def _ascii(data: bytes) -> bool:
    return bool(data) and all(32 <= b < 127 or b in (9, 10, 13) for b in data)


def toy_pair(
    *,
    noise: float = 0.05,
    sharpness: float = 20.0,
    kernels: str = "auto",
    ascii_only: bool = True,
    attention: bool = False,
    tokenizers: tuple[Any, Any] | None = None,
) -> Pair:
    """Tiny Gemma target ← the same network re-indexed to the assistant's vocabulary (+ noise).

    ``sharpness`` scales the final norm, so the logits are spread out as a trained model's are
    (a random tiny model's are nearly flat, and its top-k set would be a coin toss). Attention
    outputs are zeroed: the next-token distribution then depends on the last token's bytes
    only, which both vocabularies spell alike, so the two models agree as a trained pair would
    (random networks fed two different tokenisations otherwise share nothing). ``attention``
    True keeps them: the output then depends on the context instead of settling into a loop
    of one token, and the two agree less (where the tokenisations differ).

    ``ascii_only`` False keeps the tokens of multi-byte characters (whole or in pieces: 'é',
    '😀' and '你好' split into byte tokens) in play, so samples can stop mid-character.
    ``tokenizers``: (target, assistant) instead of ``toy_tokenizers()``."""
    target_tok, assistant_tok = tokenizers or toy_tokenizers()
    target = tiny_gemma(len(target_tok))
    table_t = token_bytes_table(target_tok, len(target_tok))
    with torch.no_grad():
        target.model.norm.weight.fill_(sharpness - 1.0)  # Gemma's norm scales by 1 + weight
        for layer in target.model.layers if not attention else ():
            layer.self_attn.o_proj.weight.zero_()
        for tid, data in enumerate(table_t):  # a zero (tied) row: a logit of 0, never top-k,
            if ascii_only and not _ascii(data):  # samples then stay whole ASCII characters
                target.get_input_embeddings().weight[tid].zero_()
    assistant = noisy_copy(target, scale=noise)
    assistant.resize_token_embeddings(len(assistant_tok), mean_resizing=False)
    spelled = {data: i for i, data in enumerate(table_t)}
    emb_t = target.get_input_embeddings().weight  # tied with the head in Gemma
    emb_a = assistant.get_input_embeddings().weight
    with torch.no_grad():
        for aid, data in enumerate(token_bytes_table(assistant_tok, len(assistant_tok))):
            tid = spelled.get(data)
            if data and tid is not None:
                emb_a[aid] = emb_t[tid] + noise * 0.1 * torch.randn_like(emb_t[tid])
            else:
                emb_a[aid].zero_()
    return make_pair(
        wrap_model(target, target_tok, ref="toy-target"),
        wrap_model(assistant, assistant_tok, ref="toy-assistant"),
        kernels=kernels,
    )
