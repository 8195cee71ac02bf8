"""GGUF files (llama.cpp): metadata -> a transformers config, tensors dequantized to the model dtype and renamed
to HF names. llama.cpp's converter permutes attn_q / attn_k rows for its rope layout; we undo that here.

Reading a GGUF is slow (the metadata parser and the tokenizer conversion are pure Python, and every tensor is
dequantised), so the first load keeps a dequantised copy on disk (--gguf-cache-dir): config.json + safetensors
per dtype, and the converted tokenizer. Later loads read that copy. The key is the file's path, size and mtime."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
CACHE_VERSION = 1
SHARD_BYTES = 2**30

logger = logging.getLogger(__name__)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_config(reader):
    """A transformers config built from the GGUF metadata."""
    from kestrel.loader import light_auto

    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    heads = g("attention.head_count")
    cfg = light_auto.config_for_model(
        arch if arch != "llama" else "llama",
        vocab_size=vocab, hidden_size=g("embedding_length"), intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads,
        num_key_value_heads=g("attention.head_count_kv", heads), max_position_embeddings=g("context_length", 4096),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=g("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    cfg.architectures = [_ARCHS[arch]]
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(reader, cfg, dtype: torch.dtype, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not progress, leave=False):
        base, suffix = t.name.rsplit(".", 1)
        parts = base.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
        else:
            name = f"{_TOP_NAMES[parts[0]]}.{suffix}"
        w = dequantize(t.data, t.tensor_type)
        if arch == "llama" and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            n = cfg.num_attention_heads if parts[2] == "attn_q" else cfg.num_key_value_heads
            w = _unpermute(w, n)
        yield name, torch.from_numpy(np.array(w, copy=True)).to(dtype)


def open_gguf(path: Path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


# ------------------------------------------------------------------ the dequantised copy on disk
def cache_folder(path: Path, cache_dir: str) -> Path:
    st = path.stat()
    key = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return Path(cache_dir).expanduser() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def weights_folder(path: Path, cache_dir: str, dtype: torch.dtype) -> Path:
    return cache_folder(path, cache_dir) / str(dtype).removeprefix("torch.")


def _publish(tmp: Path, final: Path) -> None:
    """Move a finished temporary folder into place; another process may have won the race (fine)."""
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path: Path, dtype: torch.dtype, cache_dir: str | None, progress: bool = True):
    """(hf_config, weights iterator) from the cached copy when there is one, else from the GGUF (writing the copy
    as the weights stream past, one shard at a time)."""
    from kestrel.loader import light_auto
    from kestrel.loader.safetensors import iter_safetensors

    folder = weights_folder(path, cache_dir, dtype) if cache_dir else None
    if folder is not None and (folder / "config.json").exists():
        logger.info("GGUF: reading the dequantised copy in %s", folder)
        return light_auto.config_from_pretrained(folder), iter_safetensors(folder, progress)
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    weights = iter_gguf(reader, cfg, dtype, progress)
    return cfg, (weights if folder is None else _write_through(weights, cfg, folder))


def _write_through(weights, cfg, folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import save_file

    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("GGUF: no dequantised copy (%s)", e)
        yield from weights
        return
    shard: dict[str, torch.Tensor] = {}
    size, n = 0, 0
    ok = False
    try:
        for name, w in weights:
            yield name, w
            shard[name] = w.contiguous()
            size += w.numel() * w.element_size()
            if size >= SHARD_BYTES:
                n += 1
                save_file(shard, str(tmp / f"model-{n:05d}.safetensors"))
                shard, size = {}, 0
        if shard:
            save_file(shard, str(tmp / f"model-{n + 1:05d}.safetensors"))
        cfg.save_pretrained(tmp)
        ok = True
    except OSError as e:
        logger.warning("GGUF: could not write the dequantised copy: %s", e)
    finally:
        if ok:
            _publish(tmp, folder)
            logger.info("GGUF: dequantised copy written to %s (later loads read it)", folder)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_tokenizer(path: Path, cache_dir: str | None):
    """The GGUF's tokenizer, converted once and kept beside the dequantised weights."""
    from kestrel.loader import light_auto

    folder = cache_folder(path, cache_dir) / "tokenizer" if cache_dir else None
    if folder is not None and folder.is_dir():
        return light_auto.tokenizer_from_pretrained(folder)
    tokenizer = light_auto.tokenizer_from_pretrained(path.parent, gguf_file=path.name)
    if folder is not None:
        tmp = folder.parent / f".tokenizer.tmp-{os.getpid()}"
        try:
            tokenizer.save_pretrained(str(tmp))
            _publish(tmp, folder)
        except OSError as e:
            logger.warning("GGUF: could not keep the converted tokenizer: %s", e)
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
