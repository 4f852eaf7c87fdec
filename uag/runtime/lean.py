"""A lean forward for Llama, Qwen2 and Gemma 3 decoders: the model's own modules, none of the
plumbing.

Why: at batch size 1 a decode step on a CPU spends as long in Transformers' per-call machinery
(mask construction, cache classes, attention dispatch, output capture) as in its matrix
products. Measured on the default pair (2 AVX2 cores): SmolLM2-135M int8 drafts a token in
~41 ms through ``model.base_model`` but only ~13 ms of that is its linears. This module runs
the same layers, norms, MLPs, rotary tables and linears (so kernel swaps apply unchanged), and
replaces only what surrounds them:

* ``LeanCache``: one preallocated key/value tensor per layer; rolling back is setting a length.
  Sliding-window layers keep every position and attend to the last ``window`` of them, so a
  rollback never loses states (no "past recording" mode needed).
* attention row by row for forwards of up to ``ROWWISE_MAX_ROWS`` rows: each query row is one
  SDPA call over exactly the keys it may see, with no mask, so a row's result cannot depend on
  how many rows share the forward (what lossless verification needs); longer forwards (the
  target's prompt prefill, the same call in every mode) run one masked call.
* q/k/v and gate/up fused into one product each, norms as one ``F.rms_norm``; and with the native
  kernels each layer of a forward of up to 16 rows (the assistant's prompts too:
  ``native_prompts``) is one call into ``csrc/layer.c`` (``uag.kernels.layer``), also row by row.

Once built, a ``LeanBody`` holds plain tensors and uag's own modules only (embedding rows, rotary
frequencies, norms, linears), no Transformers object: ``uag.runtime.prepared`` saves a converted one and
memory-maps it on later starts, without importing or building the Transformers model.

Anything else (other architectures, attention soft-capping, bidirectional attention, rotary
embeddings whose frequencies change with the length) keeps the Transformers path:
``lean_body_for`` returns None and ``CachedLM`` falls back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from uag.kernels.choice import ROWWISE_MAX_ROWS
from uag.kernels.layer import NativeLayers
from uag.kernels.native import NativeLinear, fuse

LEAN_MODEL_TYPES = ("llama", "gemma3_text", "qwen2")
"""Decoder families whose layer structure ``LeanBody`` reproduces exactly (Qwen2 is Llama's
layer with biases on q, k and v, which the linears carry: ``NativeLinear.bias_padded``)."""


class LeanCache:
    """Keys and values of every layer, ``[kv_heads, capacity, head_dim]`` each, and a length."""

    def __init__(
        self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: Any
    ) -> None:
        self._shape = (kv_heads, head_dim)
        self._dtype, self._device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.layers = layers
        self.capacity = 0
        self.length = 0
        self.reserve(256)

    def reserve(self, total: int) -> None:
        """Make room for ``total`` positions (capacity doubles, so growth is rare)."""
        if total <= self.capacity:
            return
        capacity = max(total, 2 * self.capacity)
        kv_heads, head_dim = self._shape

        def grow(old: list[torch.Tensor]) -> list[torch.Tensor]:
            out = []
            for layer in range(self.layers):
                new = torch.empty(
                    kv_heads, capacity, head_dim, dtype=self._dtype, device=self._device
                )
                if old:
                    new[:, : self.length] = old[layer][:, : self.length]
                out.append(new)
            return out

        self.keys, self.values = grow(self.keys), grow(self.values)
        self.capacity = capacity

    def crop(self, keep: int) -> None:
        """Forget every position from ``keep`` on."""
        self.length = min(self.length, keep)

    def prefix(self, keep: int) -> LeanCache:
        """A new cache holding a copy of this one's first ``keep`` positions."""
        kv_heads, head_dim = self._shape
        out = LeanCache(
            layers=self.layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=self._dtype,
            device=self._device,
        )
        out.reserve(keep)
        for mine, theirs in ((self.keys, out.keys), (self.values, out.values)):
            for layer in range(self.layers):
                theirs[layer][:, :keep] = mine[layer][:, :keep]
        out.length = keep
        return out

    def get_seq_length(self) -> int:
        return self.length


class _Embedding:
    """Token rows times the model's embedding scale (Gemma: √hidden, as Transformers applies it).

    The rows come from the weight in whatever exact form the native kernels hold it (the
    screened head's blocks when the embedding is tied to the head, else the embedding's own
    blocks), or from the fp32 weight itself: the same values either way.
    """

    def __init__(self, module: Any, *, exact: Any = None) -> None:
        self.weight: torch.Tensor | None = None if exact is not None else module.weight.detach()
        self.exact = exact
        """A ``uag.kernels.native.NativeLinear`` holding the same rows exactly (or None)."""
        scale = getattr(module, "embed_scale", None)
        self.scale = None if scale is None else scale.to(module.weight.dtype)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.exact is not None:  # scaled in the same fp32 multiply, in one C call
            return self.exact.rows(ids, scale=1.0 if self.scale is None else float(self.scale))
        assert self.weight is not None
        rows = F.embedding(ids, self.weight)
        return rows if self.scale is None else rows * self.scale


class _Rope:
    """Rotary cos/sin per layer kind, computed as Transformers' Llama and Gemma 3 modules do
    (position times inverse frequency, doubled, cos/sin times the attention scaling), from
    their own frequency tables (any rope type whose tables do not change with the length)."""

    BLOCK = 64
    """Positions per computed block of the CPU table: a fresh block costs what one forward's
    rows did (~0.1 ms, ten cold ops); later forwards slice it."""

    def __init__(self, rotary: Any, kinds: list[str], *, gemma: bool) -> None:
        self.tables: dict[str, tuple[torch.Tensor, float]] = {}
        for kind in sorted(set(kinds)):
            if gemma:
                inv = getattr(rotary, f"{kind}_inv_freq")
                scaling = getattr(rotary, f"{kind}_attention_scaling")
            else:
                inv, scaling = rotary.inv_freq, rotary.attention_scaling
            self.tables[kind] = (inv.detach().float().clone(), float(scaling))
        self._table: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        """float32 cos/sin rows for positions 0, 1, ... on the device: grown on demand, never saved."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``positions`` ``[n]`` (consecutive) → ``{kind: (cos [n, d], sin [n, d])}``.

        The rows are slices of one float32 table on the positions' device, grown 64 positions
        at a time: a position's rows are the same bits whichever forward asks, however many
        rows it has (computed per forward, a vectorised cos could round an entry differently in
        a short call's scalar tail), on every device and dtype (the slice is then rounded to
        ``dtype``, an elementwise, exactly rounded conversion)."""
        start, n = int(positions[0]), int(positions.shape[0])
        return {
            kind: (c[start : start + n].to(dtype), s[start : start + n].to(dtype))
            for kind, (c, s) in self.table(start + n, positions.device).items()
        }

    def table(self, upto: int, device: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{kind: (cos, sin)}``, float32 ``[P, d]`` each for positions 0 .. P - 1 with
        P >= ``upto``: the whole table, grown first where it is shorter. The native layers
        read a forward's rows from it by address (no slicing: a decode step's torch calls
        each cost tens of microseconds on caches the weights just streamed through)."""
        have = 0 if self._table is None else next(iter(self._table.values()))[0].shape[0]
        if upto > have:  # grow: double, in blocks computed one call each (no thread split)
            end = max(-(-upto // self.BLOCK) * self.BLOCK, 2 * have)
            blocks = [
                self._compute(torch.arange(b, b + self.BLOCK, device=device))
                for b in range(have, end, self.BLOCK)
            ]
            old = [] if self._table is None else [self._table]
            self._table = {
                kind: (
                    torch.cat([t[kind][0] for t in old + blocks]),
                    torch.cat([t[kind][1] for t in old + blocks]),
                )
                for kind in blocks[0]
            }
        assert self._table is not None
        return self._table

    def _compute(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for kind, (inv, scaling) in self.tables.items():
            freqs = positions[:, None].float() * inv.to(positions.device)
            emb = torch.cat((freqs, freqs), dim=-1)
            out[kind] = ((emb.cos() * scaling).contiguous(), (emb.sin() * scaling).contiguous())
        return out


def _rope_is_static(rotary: Any) -> bool:
    """Whether the rotary tables stay fixed (dynamic and longrope types rescale with length)."""
    types = getattr(rotary, "rope_type", "default")
    kinds = types.values() if isinstance(types, dict) else [types]
    return all("dynamic" not in t and t != "longrope" for t in kinds)


_GELU_TANH = functools.partial(F.gelu, approximate="tanh")


def _activation(module: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function Transformers' activation module computes (picklable), or None if unknown."""
    name = type(module).__name__
    if name in ("SiLUActivation", "SiLU"):
        return F.silu
    if name in ("GELUTanh", "PytorchGELUTanh"):
        act = getattr(module, "act", None)
        if isinstance(act, functools.partial) and act.func is F.gelu:
            return _GELU_TANH
    return None


class _Norm:
    """RMS norm as one fused op (``F.rms_norm``): Llama's weight, Gemma's ``1 + weight``."""

    def __init__(self, module: Any, *, gemma: bool) -> None:
        weight = module.weight.detach().float()
        self.weight = 1.0 + weight if gemma else weight.clone()  # its own storage, not the file's
        self.eps = float(getattr(module, "eps", getattr(module, "variance_epsilon", 1e-6)))
        self.shape = (int(weight.shape[0]),)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # bf16/fp16 (GPUs): normalise in fp32, as Transformers
            return F.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class _Layer:
    """One decoder layer's pieces, with q/k/v and gate/up fused where the kernels allow."""

    def __init__(self, layer: Any, *, gemma: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norms = [
            _Norm(getattr(layer, name), gemma=gemma)
            for name in (
                (
                    "input_layernorm",
                    "post_attention_layernorm",
                    "pre_feedforward_layernorm",
                    "post_feedforward_layernorm",
                )
                if gemma
                else ("input_layernorm", "post_attention_layernorm")
            )
        ]
        self.qk_norms = (
            (_Norm(attn.q_norm, gemma=True), _Norm(attn.k_norm, gemma=True)) if gemma else None
        )
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        _integer([self.q, self.k, self.v, self.o, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
        self.qkv = fuse([self.q, self.k, self.v])
        self.splits = [int(m.out_features) for m in (self.q, self.k, self.v)]
        act = _activation(mlp.act_fn)
        assert act is not None, "lean_body_for checks the activation"
        self.gate, self.up, self.down, self.act = mlp.gate_proj, mlp.up_proj, mlp.down_proj, act
        self.gate_up = fuse([self.gate, self.up])  # fuse packs what it joins; the rest:
        unfused = (*(() if self.qkv else (self.q, self.k, self.v)),
                   *(() if self.gate_up else (self.gate, self.up)))  # fmt: skip
        for linear in (self.o, self.down, *unfused):
            if isinstance(linear, NativeLinear):
                linear.pack()
                linear.factor()

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q(x), self.k(x), self.v(x)
        q, k, v = self.qkv(x).split(self.splits, dim=-1)
        return q, k, v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down(self.act(self.gate(x)) * self.up(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class LeanBody:
    """``model.base_model`` for one sequence: ``(ids [n], cache) → last hidden states [n, h]``."""

    def __init__(self, model: Any) -> None:
        body = model.base_model
        config = model.config
        self.gemma = config.model_type == "gemma3_text"
        self.layer_types: list[str] = list(
            getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        )
        self.window: int | None = getattr(config, "sliding_window", None)
        attn = body.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.kv_heads = int(config.num_key_value_heads)
        self.groups = int(config.num_attention_heads) // self.kv_heads
        self.scaling = float(attn.scaling)
        self.layers = [_Layer(layer, gemma=self.gemma) for layer in body.layers]
        self.final_norm = _Norm(body.norm, gemma=self.gemma)
        self.embed = _Embedding(body.embed_tokens, exact=_exact_rows(model))
        self.rope = _Rope(body.rotary_emb, self.layer_types, gemma=self.gemma)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.pad_rows = 0
        """Forwards of ``n <= pad_rows`` rows run every product, norm and activation on
        ``pad_rows`` rows (zeros after the real ones; attention and the cache see the real rows
        only): every decode step and verify then has one shape, so kernels whose rounding
        depends on the row count (a GPU's GEMV against its GEMM, oneDNN's vector tails) compute
        a position the same way in both. 0: off (the native layers compute rows alone anyway).
        Set by ``uag.runtime.invariance``."""
        self.attach_native()

    def attach_native(self) -> None:
        self.native = NativeLayers.for_body(self)
        """Each layer as one ``layer.c`` call (forwards of ≤ 16 rows), where the kernels allow."""
        # kept across a re-attach (after a move into huge pages), where the native layers exist
        half = self.native is not None and getattr(self, "kv_dtype", None) == torch.float16
        self.kv_dtype = torch.float16 if half else self.dtype
        """The cache's dtype for keys and values (``half_kv``)."""
        if half:
            assert self.native is not None
            self.native.set_kv_half(True)
        self.prompts_native = self.native is not None and getattr(self, "prompts_native", False)
        """Whether forwards of over 16 rows run on the native layers too (``native_prompts``)."""

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the C structs (rebuilt on load: they point into this process)."""
        state = self.__dict__.copy()
        state.pop("native", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("pad_rows", 0)
        self.__dict__.update(state)
        self.attach_native()

    def streamed(self) -> list[tuple[Any, str]]:
        """What every native forward reads in full: its layers' weights, as slots for
        ``uag.kernels.hugepages.move`` (none where the layers do not run natively)."""
        if self.native is None:
            return []
        linears = (
            m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        return [slot for m in linears if m is not None for slot in m.streamed()]

    def new_cache(self) -> LeanCache:
        return LeanCache(
            layers=len(self.layers),
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )

    def half_kv(self) -> bool:
        """Cache keys and values as half floats from the next ``new_cache`` on, where this body
        runs on the native layers (float32 on CPU); return whether it does.

        For the assistant only: its outputs may be approximate (the target decides every token),
        and a decode step's attention reads the whole cache, ~14 MB of float keys and values at a
        300-token context against its ~95 MB of weights. The target's stay float (its output is
        the reference). Half floats widen exactly to float, so the torch path (prompt prefill)
        reads the same values the native one does.
        """
        if self.native is None:
            return False
        self.kv_dtype = torch.float16
        self.native.set_kv_half(True)
        return True

    PROMPT_ROWS = 256
    """Rows per piece of a long forward on the native layers (``native_prompts``): scratch for
    ~30 KB a row (SmolLM2), and each piece reads the weights once more."""

    def native_prompts(self) -> bool:
        """Run forwards of any length (a prompt's prefill) on the native layers too, in pieces of
        ``PROMPT_ROWS``, where this body has them; return whether it does.

        Both models of a pair (``uag.api``): each prompt row is then bitwise what a one-row
        forward gives it (``layer.c`` computes rows on their own), so a prefix's cached states
        do not depend on how its rows were grouped into forwards, and a server may keep them
        for the next request (``CachedLM.keep_prefixes``); the torch path's block attention
        rounds a row differently with the rows beside it. Faster too: SmolLM2's 115-token
        prefill ~95 ms through the torch path (~20 small calls per layer, each a parallel
        region, around the same products), ~64 ms here; Gemma 3 270M's 600 tokens 1053 → 807
        ms (Zen 4, 2 threads)."""
        if self.native is None:
            return False
        self.prompts_native = True
        return True

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, cache: LeanCache) -> torch.Tensor:
        """Feed ``ids`` (``[n]``) after the ``cache.length`` positions already cached."""
        start, n = cache.length, int(ids.shape[0])
        cache.reserve(start + n)
        hidden = self.embed(ids)  # [n, h]
        if self.native is not None and (n <= ROWWISE_MAX_ROWS or self.prompts_native):
            hidden, piece = hidden.contiguous(), self.PROMPT_ROWS
            tables = self.rope.table(start + n, self.device)  # rows by address, no slicing
            for lo in range(0, n, piece):  # a decode step or verify: one call; a prompt in pieces
                self.native(hidden[lo : lo + piece], cache, start + lo, tables)
            cache.length = start + n
            return self.native.norm(hidden, self.final_norm, out=hidden)  # this call's own
        positions = torch.arange(start, start + n, device=self.device)  # [n]
        rope = self.rope(positions, hidden.dtype)  # {kind: ([n, d], [n, d])}
        pad = self.pad_rows - n if n <= self.pad_rows else 0
        if pad:  # one shape for every short forward (``pad_rows``)
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            rope = self.rope(torch.arange(start, start + n + pad, device=self.device), hidden.dtype)
        rope = {kind: (cos[:, None, :], sin[:, None, :]) for kind, (cos, sin) in rope.items()}
        for index, layer in enumerate(self.layers):
            kind = self.layer_types[index]
            window = self.window if kind == "sliding_attention" else None
            x = self._attention(
                layer, layer.norms[0](hidden), rope[kind], cache, index, start, window, real=n
            )
            if self.gemma:
                hidden = hidden + layer.norms[1](x)
                hidden = hidden + layer.norms[3](layer.mlp(layer.norms[2](hidden)))
            else:
                hidden = hidden + x
                hidden = hidden + layer.mlp(layer.norms[1](hidden))
        cache.length = start + n
        return self.final_norm(hidden)[:n]

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: LeanCache,
        index: int,
        start: int,
        window: int | None,
        *,
        real: int,
    ) -> torch.Tensor:
        """Attention of the first ``real`` rows of ``x`` (the rest pad the products' shape, see
        ``pad_rows``: they write no keys and attend to nothing)."""
        n, d = x.shape[0], self.head_dim
        q, k, v = layer.project_qkv(x)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)  # [n, heads, d]
        if layer.qk_norms is not None:
            q, k = layer.qk_norms[0](q), layer.qk_norms[1](k)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.keys[index], cache.values[index]
        keys[:, start : start + real] = k[:real].transpose(0, 1)
        values[:, start : start + real] = v[:real].transpose(0, 1)
        if real <= ROWWISE_MAX_ROWS:
            rows = [self._attend_row(q[i], keys, values, start + i, window) for i in range(real)]
            if n > real:
                rows.append(q.new_zeros(n - real, q.shape[1] * d))
            out = torch.cat(rows)
        else:
            out = self._attend_block(q, keys, values, start, window)
        return layer.o(out)  # [n, h]

    def _attend_row(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: int,
        window: int | None,
    ) -> torch.Tensor:
        """One query position ``q`` ``[hq, d]`` over the keys it may see → ``[1, hq * d]``.

        The query heads sharing a key head ride as that head's query rows (grouped-query
        attention without copying keys); the call has the same shape however many rows the
        forward holds.
        """
        lo = 0 if window is None else max(0, position - window + 1)
        query = q.view(1, self.kv_heads, self.groups, self.head_dim)
        out = F.scaled_dot_product_attention(
            query,
            keys[None, :, lo : position + 1].to(q.dtype),
            values[None, :, lo : position + 1].to(q.dtype),
            scale=self.scaling,
        )
        return out.reshape(1, -1)

    def _attend_block(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        window: int | None,
    ) -> torch.Tensor:
        """Every query row in one masked call (long forwards: prompt prefill)."""
        n, total = q.shape[0], start + q.shape[0]
        query_pos = torch.arange(start, total, device=q.device)[:, None]
        key_pos = torch.arange(total, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
        k = keys[:, :total].to(q.dtype).repeat_interleave(self.groups, dim=0)  # [hq, L, d]
        v = values[:, :total].to(q.dtype).repeat_interleave(self.groups, dim=0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=self.scaling
        )  # [1, hq, n, d]
        return out[0].transpose(0, 1).reshape(n, -1)


def _integer(linears: list[Any]) -> None:
    """The layer's exact block storage onto ``exact.c`` where it runs fast
    (``NativeLinear.to_integer``), before fusing: a verify's extra rows then cost integer
    products, not fp32 multiply-adds, and every row still computes alone."""
    for linear in linears:
        if isinstance(linear, NativeLinear):
            linear.to_integer()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_body_for(model: Any) -> LeanBody | None:
    """A ``LeanBody`` when ``model`` is a decoder this module reproduces exactly, else None."""
    config = model.config
    if getattr(config, "model_type", None) not in LEAN_MODEL_TYPES:
        return None
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return None
    if getattr(config, "use_bidirectional_attention", False):
        return None
    if config.model_type == "llama" and getattr(config, "sliding_window", None):
        return None
    if not _rope_is_static(model.base_model.rotary_emb):
        return None
    if any(_activation(layer.mlp.act_fn) is None for layer in model.base_model.layers):
        return None
    return LeanBody(model)


def _exact_rows(model: Any) -> Any:
    """A native, exact copy of the embedding's rows when the model runs on native kernels: the
    screened head's blocks if the embedding is tied to the head, else the embedding's own
    blocks (GGUF's Q8_0: a quarter of the fp32 bytes); None keeps the fp32 weight."""
    if not any(isinstance(m, NativeLinear) for m in model.modules()):
        return None
    weight = model.base_model.embed_tokens.weight
    head = getattr(model, "_uag_fast_head", None)
    exact = getattr(head, "exact", None)
    if exact is not None and getattr(model.get_output_embeddings(), "weight", None) is weight:
        return exact
    return NativeLinear.exact_blocks_of(weight.detach())
