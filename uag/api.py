"""The public Python API: load a model pair once, generate with the product's plan or any other.

import uag
pair = uag.load_pair()                                  # gemma-3-270m ← smollm2-135m
out = uag.generate(pair, "def fib(n):", max_new_tokens=64)   # the plan uag generate runs
ref = uag.generate(pair, "def fib(n):", max_new_tokens=64, plan=None)  # target alone
assert out.token_ids == ref.token_ids
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from uag import recipes
from uag.decoding.bridge import Bridge
from uag.decoding.plan import Plan
from uag.decoding.round import Generation, IterationRecord, LoopOutput, OnTokens, StopReason
from uag.decoding.sampling import (
    Intersection,
    SamplingConfig,
    special_ids,
)
from uag.decoding.speculative import Assisting, speculate, target_alone
from uag.errors import UagError
from uag.kernels.choice import (
    quantize_int8,
    resolve_kernels,
)
from uag.runtime import prepared
from uag.runtime.draft_vocab import check_size
from uag.runtime.models import (
    DEFAULT_ASSISTANT,
    DEFAULT_TARGET,
    LoadedModel,
    check_reference,
    load_model,
    resolve_device,
    resolve_dtype,
)
from uag.runtime.runner import CachedLM, assistant_lm_for, target_lm_for


@dataclass
class Pair:
    """A target and an assistant ready for generation, with the bridge between their vocabularies."""

    target: LoadedModel
    assistant: LoadedModel
    bridge: Bridge
    target_lm: CachedLM = field(repr=False)
    assistant_lm: CachedLM = field(repr=False)
    assistant_int8: bool = False
    kernels: str = "plain"
    """Kernels the models run on: ``native`` (uag's, CPU fp32), ``onednn`` or ``plain``."""
    _intersection: Intersection | None = field(default=None, repr=False)
    _recipes: dict[bool, recipes.Recipe] = field(default_factory=dict, repr=False)

    def default_plan(self, *, sampling: bool = False) -> recipes.Recipe:
        """The product's plan for this pair (``uag.recipes.default_plan``), built once per
        decoding mode: what ``generate`` runs without ``plan=``, as ``uag generate`` does."""
        if sampling not in self._recipes:
            self._recipes[sampling] = recipes.default_plan(self, sampling=sampling)
        return self._recipes[sampling]

    def keep_prefixes(self, positions: int = 8192) -> list[str]:
        """Each model keeps its recent sequences (up to ``positions`` cached positions each)
        and starts a new prompt from the longest prefix one of them shares
        (``CachedLM.keep_prefixes``: where that is exact); returns the roles that do. For a
        server: a chat's next turn re-reads only its new messages."""
        return [
            role
            for role, lm in (("target", self.target_lm), ("assistant", self.assistant_lm))
            if lm.keep_prefixes(positions)
        ]

    def sampling(
        self,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> SamplingConfig:
        """Sampling as ``uag generate --sample`` sets it: each value given here, else the
        target's ``generation_config``, else the built-in one (``uag.recipes``)."""
        return recipes.sampling_settings(
            self.target.ref, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        ).config

    def intersection(self) -> Intersection:
        """The vocabulary intersection speculative sampling drafts from (built on first use)."""
        if self._intersection is None:
            self._intersection = Intersection.build(
                self.bridge,
                target_special=special_ids(self.target.tokenizer),
                assistant_special=special_ids(self.assistant.tokenizer),
            )
        return self._intersection

    @property
    def draft_vocab(self) -> int:
        """Greedy drafts come from the assistant's first N ids (``uag.runtime.draft_vocab``); 0: all."""
        return self.assistant_lm.draft_vocab


@dataclass
class GenerationResult:
    """One generation: the text, the target token ids, and per-iteration records."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    stop_reason: StopReason
    seconds: float
    policy: str
    """The plan's name (``RulePlan``'s in the policy grammar: ``static-3+lookup``), or
    ``target-only``."""
    iterations: list[IterationRecord]

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def target_forwards(self) -> int:
        return len(self.iterations) if self.iterations else self.new_tokens

    @property
    def drafted_tokens(self) -> int:
        return sum(r.drafted for r in self.iterations)

    @property
    def accepted_drafts(self) -> int:
        return sum(r.accepted_drafts for r in self.iterations)

    @property
    def accepted_tokens(self) -> int:
        """Target tokens that came from the draft (accepted candidates)."""
        return sum(r.accepted_candidates for r in self.iterations)

    @property
    def copied_tokens(self) -> int:
        """Candidates that prompt lookup copied (``uag.decoding.lookup``), and below, how many of them
        the target accepted: the lookup's own acceptance, apart from the assistant's."""
        return sum(r.candidates for r in self.iterations if r.lookup)

    @property
    def copied_accepted(self) -> int:
        return sum(r.accepted_candidates for r in self.iterations if r.lookup)

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted assistant tokens whose text the target accepted."""
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def wasted_drafts(self) -> int:
        return self.drafted_tokens - self.accepted_drafts

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        """Seconds spent drafting, verifying, bridging, in the policy, and elsewhere."""
        split = {
            "draft": sum(r.draft_s for r in self.iterations),
            "verify": sum(r.verify_s for r in self.iterations),
            "bridge": sum(r.bridge_s for r in self.iterations),
            "policy": sum(r.policy_s for r in self.iterations),
        }
        split["other"] = max(self.seconds - sum(split.values()), 0.0)
        return split

    def summary(self) -> dict[str, Any]:
        """The stats as a JSON-ready dict."""
        return {
            "policy": self.policy,
            "text": self.text,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "stop_reason": self.stop_reason,
            "target_forwards": self.target_forwards,
            "tokens_per_target_forward": round(self.tokens_per_forward, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_drafts": self.accepted_drafts,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "wasted_drafts": self.wasted_drafts,
            "copied_tokens": self.copied_tokens,
            "copied_accepted": self.copied_accepted,
            "tokens_per_second": round(self.tokens_per_second, 3),
            "seconds": round(self.seconds, 4),
            "time_split": {k: round(v, 4) for k, v in self.time_split().items()},
        }


def load_pair(
    target: str = DEFAULT_TARGET,
    assistant: str = DEFAULT_ASSISTANT,
    *,
    device: str = "auto",
    dtype: str = "auto",
    assistant_int8: bool | None = None,
    kernels: str = "auto",
    draft_vocab: int | None = None,
) -> Pair:
    """Load both models and build the bridge (GGUF references are converted once, then cached).
    ``assistant_int8``: the assistant on 4-bit / int8 weights (``resolve_assistant_int8``; None:
    on wherever it can run, i.e. on CPU in float32). ``draft_vocab``: greedy drafts from the
    assistant's first N ids (``uag.runtime.draft_vocab``; None: the default where its head can
    be cut; 0: every id)."""
    check_size(draft_vocab)
    for ref in (target, assistant):
        check_reference(ref)
    dev = resolve_device(device)
    mode = resolve_kernels(kernels, dev, resolve_dtype(dtype, dev))  # refuse before loading
    assistant_int8 = resolve_assistant_int8(assistant_int8, device=device, dtype=dtype)
    if mode == "native":
        pair = _prepared_pair(
            target, assistant, assistant_int8=assistant_int8, draft_vocab=draft_vocab
        )
        if pair is not None:
            return pair
    tgt = load_model(target, device=device, dtype=dtype)
    ast = load_model(assistant, device=device, dtype=dtype)
    if assistant_int8:
        if ast.device.type != "cpu" or ast.dtype != torch.float32:
            raise UagError("--assistant-int8 needs the assistant on CPU in float32")
        ast.model = quantize_int8(ast.model, backend="native" if mode == "native" else None)
    return make_pair(
        tgt, ast, assistant_int8=assistant_int8, kernels=kernels, draft_vocab=draft_vocab
    )


def resolve_assistant_int8(
    requested: bool | None, *, device: str = "auto", dtype: str = "auto"
) -> bool:
    """Whether the assistant runs on 4-bit / int8 weights: as ``requested``, or where None, on
    exactly where it can run (the assistant on CPU in float32).

    Why on by default: only the target decides the output, so the assistant's precision changes
    the drafts' cost and acceptance, never what is generated (greedy: the target's argmax;
    sampling: the accept/resample rule is exact for any draft distribution). Why off elsewhere:
    ``uag.kernels.choice.quantize_int8``'s kernels are CPU float32 only; a GPU or a half dtype
    keeps the assistant in the pair's dtype (asking for int8 there is refused at load)."""
    if requested is not None:
        return requested
    dev = resolve_device(device)
    return dev.type == "cpu" and resolve_dtype(dtype, dev) == torch.float32


def _prepared_pair(
    target: str, assistant: str, *, assistant_int8: bool, draft_vocab: int | None
) -> Pair | None:
    """The pair from prepared files (``uag.runtime.prepared``: built on the first start), or None where
    either model cannot be prepared. Its ``LoadedModel.model`` is None: no Transformers model
    is loaded."""
    tgt = prepared.load(target, role="target")
    if tgt is None:
        return None
    ast = prepared.load(assistant, role="assistant-int8" if assistant_int8 else "assistant")
    if ast is None:
        return None
    (tgt_model, tgt_parts), (ast_model, ast_parts) = tgt, ast
    return _pair(
        tgt_model,
        ast_model,
        tgt_parts.cached_lm(),
        ast_parts.cached_lm(),
        assistant_int8=assistant_int8,
        kernels="native",
        draft_vocab=draft_vocab,
    )


def make_pair(
    target: LoadedModel,
    assistant: LoadedModel,
    *,
    assistant_int8: bool = False,
    kernels: str = "auto",
    draft_vocab: int | None = None,
) -> Pair:
    """A pair from models already in memory (e.g. your own, or tiny ones in tests).

    With ``native`` or ``onednn`` kernels the models' linear layers are swapped in place (and
    Transformers' attention set to row by row, for models without a lean forward; see
    ``uag.kernels.choice``): to time stock Transformers, load a separate copy.
    """
    mode = resolve_kernels(kernels, target.device, target.dtype)
    target_lm = target_lm_for(target.model, target.tokenizer, mode)
    assistant_lm = assistant_lm_for(assistant.model, mode)
    return _pair(
        target,
        assistant,
        target_lm,
        assistant_lm,
        assistant_int8=assistant_int8,
        kernels=mode,
        draft_vocab=draft_vocab,
    )


def _pair(
    target: LoadedModel,
    assistant: LoadedModel,
    target_lm: CachedLM,
    assistant_lm: CachedLM,
    *,
    assistant_int8: bool,
    kernels: str,
    draft_vocab: int | None = None,
) -> Pair:
    """The pair, with the bridge between the two vocabularies; each model's streamed weights
    in huge pages (``uag.kernels.hugepages``: a move already under way finishes last), then the
    assistant's draft head (a view of its head's memory, so after the move)."""
    bridge = Bridge.for_tokenizers(
        target=target.tokenizer,
        assistant=assistant.tokenizer,
        target_vocab=target_lm.vocab_size,
        assistant_vocab=assistant_lm.vocab_size,
    )
    for lm in (target_lm, assistant_lm):
        lm.move_to_huge_pages()
    if assistant_lm.lean is not None:  # half-float keys and values
        assistant_lm.lean.half_kv()
    for lm in (target_lm, assistant_lm):
        if lm.lean is not None:  # prompts on layer.c too: every row computed on its own
            lm.lean.native_prompts()
            lm.reset([], rollback=False)
    assistant_lm.set_draft_vocab(draft_vocab)
    return Pair(target, assistant, bridge, target_lm, assistant_lm, assistant_int8, kernels)


def render_prompt(pair: Pair, prompt: str, *, chat: bool) -> str:
    """The prompt text both models see: raw, or wrapped in the target's chat template."""
    if not chat:
        return prompt
    return render_chat(pair, [{"role": "user", "content": prompt}], flag="--chat: ")


def render_chat(pair: Pair, messages: list[dict[str, str]], *, flag: str = "") -> str:
    """A conversation (``role`` / ``content`` messages) as the text the target's own chat
    template makes of it, ready for the assistant's turn; ``flag`` starts each error."""
    tok = pair.target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise UagError(f"{flag}target {pair.target.ref!r} has no chat template")
    try:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # jinja2's TemplateError, Transformers' ValueError...: the model's template, not uag's code.
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UagError(f"{flag}target {pair.target.ref!r}'s chat template fails: {first}") from exc
    if not str(rendered).strip():
        raise UagError("prompt is empty after the target's chat template")
    return str(rendered)


def encode_prompt(pair: Pair, text: str) -> tuple[list[int], list[int]]:
    """Target and assistant prompt ids for the same text; each model gets its own BOS rules."""

    def encode(model: LoadedModel) -> list[int]:
        tok = model.tokenizer
        bos = tok.bos_token
        # A chat template that already wrote the BOS text must not get a second one.
        add_special = not (bos and text.startswith(bos))
        return list(tok(text, add_special_tokens=add_special)["input_ids"])

    return encode(pair.target), encode(pair.assistant)


def check_prompt(prompt: object) -> str:
    """``prompt`` as the one prompt text to generate from, or a ``UagError`` saying why not."""
    if isinstance(prompt, (list, tuple)):
        if len(prompt) != 1:
            raise UagError(
                f"batch size {len(prompt)} is not supported: uag generates one prompt at a time"
            )
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise UagError(f"prompt must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise UagError("prompt is empty" if not prompt else "prompt is only whitespace")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate: bytes that were not UTF-8 upstream
        raise UagError(
            f"prompt is not valid text: {prompt[err.start]!r} at character {err.start} is a lone "
            "surrogate (bytes that were not UTF-8, e.g. in a shell argument)"
        ) from None
    return prompt


def _check_length(pair: Pair, target_ids: list[int], assistant_ids: list[int], new: int) -> None:
    """Refuse a prompt either model reads as no tokens, or one the target's context cannot hold
    with ``new`` tokens after it (uag never runs the target past the positions it was trained
    for)."""
    if not target_ids or not assistant_ids:
        raise UagError("prompt encodes to no tokens")
    context = pair.target.context
    if context is not None and len(target_ids) + new > context:
        raise UagError(
            f"prompt is {len(target_ids)} target tokens and max_new_tokens {new}: more than "
            f"the target's context of {context} tokens (shorten the prompt or lower "
            "--max-new-tokens)"
        )


def generate(
    pair: Pair,
    prompt: str | list[str],
    *,
    plan: Plan | None | str = "default",
    max_new_tokens: int = 128,
    chat: bool = False,
    on_text: Callable[[str], bool | None] | None = None,
    keep_steps: bool = False,
    sampling: SamplingConfig | None = None,
) -> GenerationResult:
    """Greedy generation, or sampling with ``sampling``. ``plan`` chooses each round's action
    (``uag.decoding.plan``): by default the product's (``Pair.default_plan``, what ``uag
    generate`` runs); ``None`` runs the target alone (the reference: the same output when
    greedy, the same distribution when sampling).

    ``on_text`` receives decoded text as it is accepted (whole characters only); returning
    True halts the run after that round (``stop_reason`` "halted": a stop string, a client
    that left), the text so far still the target's own.
    """
    text_prompt = render_prompt(pair, check_prompt(prompt), chat=chat)
    if max_new_tokens < 1:
        raise UagError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if isinstance(plan, str):
        if plan != "default":
            raise UagError(f"plan must be a Plan, None or 'default', got the string {plan!r}")
        plan = pair.default_plan(sampling=sampling is not None).plan
    target_ids, assistant_ids = encode_prompt(pair, text_prompt)
    _check_length(pair, target_ids, assistant_ids, max_new_tokens)
    stream = _Streamer(pair, on_text) if on_text else None
    started = time.perf_counter()
    out = speculate_on(
        pair,
        target_ids=target_ids,
        assistant_ids=assistant_ids,
        plan=plan,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        on_tokens=stream,
        keep_steps=keep_steps,
    )
    seconds = time.perf_counter() - started
    if stream:
        stream.flush()
    return GenerationResult(
        text=pair.target.tokenizer.decode(out.ids, skip_special_tokens=True),
        token_ids=out.ids,
        prompt_tokens=len(target_ids),
        stop_reason=out.stop_reason,
        seconds=seconds,
        policy="target-only" if plan is None else plan.name,
        iterations=out.iterations,
    )


def speculate_on(
    pair: Pair,
    *,
    target_ids: list[int],
    assistant_ids: list[int],
    plan: Plan | None,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    on_tokens: OnTokens | None = None,
    keep_steps: bool = False,
    target: CachedLM | None = None,
) -> LoopOutput:
    """``speculate`` on ``pair`` (its cached models, bridge, stop tokens and, sampling, the
    vocabularies' intersection) from a prompt already encoded for both models, or with ``plan``
    None the target alone: the one place a pair is taken apart for the loop, for ``generate``,
    for runs whose plan reads every round itself (``uag collect --plan``'s sampled runs label
    each round start) and for exact replay (``target``: a recorded target in the pair's
    model's place)."""
    gen = Generation(
        target=target if target is not None else pair.target_lm,
        eos=pair.target.eos_ids,
        prompt_ids=target_ids,
        max_new_tokens=max_new_tokens,
        on_tokens=on_tokens,
    )
    if plan is None:
        return target_alone(gen, sampling=sampling)
    assisting = Assisting(
        lm=pair.assistant_lm,
        eos=pair.assistant.eos_ids,
        prompt_ids=assistant_ids,
        bridge=pair.bridge,
        intersection=pair.intersection() if sampling is not None else None,
    )
    return speculate(gen, assistant=assisting, plan=plan, sampling=sampling, keep_steps=keep_steps)


class _Streamer:
    """Turns emitted target ids into text callbacks, holding back partial UTF-8 characters."""

    def __init__(self, pair: Pair, on_text: Callable[[str], bool | None]) -> None:
        self.table = pair.bridge.target.table
        tok = pair.target.tokenizer
        # The same tokens decode(skip_special_tokens=True) drops: every added token marked special.
        self.skip = set(tok.all_special_ids) | {
            i for i, t in (getattr(tok, "added_tokens_decoder", {}) or {}).items() if t.special
        }
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.on_text = on_text

    def __call__(self, ids: list[int]) -> bool | None:
        data = b"".join(self.table[i] for i in ids if i not in self.skip)
        piece = self.decoder.decode(data)
        return self.on_text(piece) if piece else None

    def flush(self) -> None:
        piece = self.decoder.decode(b"", final=True)
        if piece:
            self.on_text(piece)
