"""Our bench checkpoint and PEFT adapters as GGUF files for llama.cpp (the CPU peer, issue 20).

A small converter on the `gguf` package (gguf-py, llama.cpp's own writer), for
exactly what `benchmarks.bench_decode.write_assets` writes: a transformers
Llama safetensors directory (float32 or bfloat16, untied embeddings, no biases,
default rope) and PEFT LoRA adapters on any of the seven projections. It is not
llama.cpp's convert_hf_to_gguf.py; it follows its conventions:

* tensor names: `token_embd`, `output_norm`, `output`, and per layer `blk.N.` +
  `attn_norm`, `attn_q/k/v/output`, `ffn_norm`, `ffn_gate/up/down` (`.weight`);
  numpy arrays in torch's [out, in] layout (GGUF stores the dims reversed);
* Q and K rows permuted from transformers' rotate-half rope to llama.cpp's
  interleaved pairs (`_permute`: per head, [2, d/2] -> [d/2, 2]; K with the KV
  head count), and for an adapter the same permutation on lora_B of q and k
  (the rows are the projection's outputs), lora_A untouched;
* 16-bit files keep 1-D tensors (norms) in float32, as llama.cpp's converter does;
  bfloat16 is written from the checkpoint's own bits (no rounding: the same
  values our bfloat16 model holds);
* adapters: `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`,
  tensors `blk.N.attn_q.weight.lora_a` ([r, in]) and `.lora_b` ([out, r]); llama.cpp
  scales by alpha / r, as PEFT does (rsLoRA adapters are refused);
* a vocabulary is required to load a model: a stand-in SentencePiece list
  (`<unk>`, `<s>`, `</s>`, then `<tN>`), since the benchmark feeds token ids and
  never tokenizes text.

It needs numpy and gguf only (no torch, no safetensors package): it runs in the
peer's own environment (build/llamacpp-venv), not in loraplane's.

    python -m benchmarks.gguf_convert model MODEL_DIR OUT.gguf [--type f32|bf16|f16]
    python -m benchmarks.gguf_convert adapter ADAPTER_DIR MODEL_DIR OUT.gguf
"""
from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np

# transformers module name -> GGUF tensor name
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down"}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
TYPES = ("f32", "bf16", "f16")


class ConvertError(ValueError):
    """The input is not a checkpoint or adapter this converter handles; the message says why."""


# ---- safetensors, read with numpy alone --------------------------------------------------

def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """{name: (dtype, array)}; bfloat16 tensors come back as their uint16 bits."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    kinds = {"F32": np.float32, "BF16": np.uint16, "F16": np.float16}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in kinds:
            raise ConvertError(f"{path}: tensor {name} is {meta['dtype']}; only F32, BF16 and F16 are read")
        start, end = meta["data_offsets"]
        arr = np.frombuffer(raw, kinds[meta["dtype"]], (end - start) // np.dtype(kinds[meta["dtype"]]).itemsize,
                            base + start).reshape(meta["shape"])
        out[name] = (meta["dtype"], arr)
    return out


def _float32(dtype: str, arr: np.ndarray) -> np.ndarray:
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' q/k rows (per head: first halves, then second halves of each rotated pair)
    in llama.cpp's order (per head: the pairs interleaved); works on lora_B as on the weight."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> tuple[str, int | None, str]:
    """(GGUF name, layer or None, module key) of a transformers tensor name."""
    if hf in _TOP_NAMES:
        return _TOP_NAMES[hf], None, hf
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"] or parts[-1] != "weight":
        raise ConvertError(f"unexpected tensor {hf!r}: not a Llama checkpoint this converter knows")
    layer, module = int(parts[2]), ".".join(parts[3:-1])
    if module not in _LAYER_NAMES:
        raise ConvertError(f"unexpected tensor {hf!r}: module {module!r} has no GGUF name here")
    return f"blk.{layer}.{_LAYER_NAMES[module]}.weight", layer, module


def _config(model_dir: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ConvertError(f"{model_dir}: model_type is {cfg.get('model_type')!r}, not llama")
    rope = cfg.get("rope_scaling") or {}
    if rope and rope.get("rope_type", rope.get("type")) not in (None, "default"):
        raise ConvertError(f"{model_dir}: rope scaling {rope} is not converted; use default rope")
    if cfg.get("tie_word_embeddings"):
        raise ConvertError(f"{model_dir}: tied embeddings are not converted here")
    return cfg


def _heads(cfg: dict[str, Any], module: str) -> int | None:
    if module == "self_attn.q_proj":
        return int(cfg["num_attention_heads"])
    if module == "self_attn.k_proj":
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    return None


def _encode(dtype: str, arr: np.ndarray, out_type: str) -> tuple[np.ndarray, Any]:
    """(array to write, raw GGML type or None) for one tensor of the checkpoint."""
    import gguf

    if out_type == "f32" or arr.ndim == 1:
        return np.ascontiguousarray(_float32(dtype, arr)), None
    if out_type == "f16":
        return np.ascontiguousarray(_float32(dtype, arr).astype(np.float16)), None
    if dtype == "BF16":  # its own bits
        bits = np.ascontiguousarray(arr)
    else:  # round to nearest even, as torch does
        u = np.ascontiguousarray(_float32(dtype, arr)).view(np.uint32)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits.view(np.uint8), gguf.GGMLQuantizationType.BF16


def convert_model(model_dir: Path, out: Path, out_type: str = "f32") -> Path:
    """MODEL_DIR (transformers Llama, safetensors) -> one GGUF file of type f32, bf16 or f16."""
    import gguf

    if out_type not in TYPES:
        raise ConvertError(f"type must be one of {', '.join(TYPES)}, got {out_type!r}")
    cfg = _config(model_dir)
    tensors = read_safetensors(model_dir / "model.safetensors")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    vocab = int(cfg["vocab_size"])
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(model_dir.name)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16}[out_type])
    w.add_vocab_size(vocab)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(hidden)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    _stand_in_vocab(w, vocab)
    for hf, (dtype, arr) in sorted(tensors.items()):
        name, _, module = _gguf_name(hf)
        h = _heads(cfg, module)
        if h is not None:
            arr = _permute(arr, h)
        data, raw = _encode(dtype, arr, out_type)
        w.add_tensor(name, data, raw_dtype=raw)
    _finish(w)
    return out


def _stand_in_vocab(w: Any, vocab: int) -> None:
    import gguf

    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<t{i}>" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _finish(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _adapter_tensors(adapter_dir: Path) -> Iterator[tuple[str, str, str, np.ndarray]]:
    """(transformers module tensor name, "a" or "b", dtype, array) of a PEFT adapter."""
    prefix = "base_model.model."
    for name, (dtype, arr) in sorted(read_safetensors(adapter_dir / "adapter_model.safetensors").items()):
        for ab in ("A", "B"):
            tail = f".lora_{ab}.weight"
            if name.startswith(prefix) and name.endswith(tail):
                yield name[len(prefix):-len(tail)] + ".weight", ab.lower(), dtype, arr
                break
        else:
            raise ConvertError(f"{adapter_dir}: tensor {name!r} is not a PEFT lora_A/lora_B weight")


def convert_adapter(adapter_dir: Path, model_dir: Path, out: Path) -> Path:
    """A PEFT LoRA adapter -> llama.cpp's GGUF LoRA file (float32) for the model in MODEL_DIR."""
    import gguf

    cfg = _config(model_dir)
    acfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    if acfg.get("peft_type", "LORA") != "LORA":
        raise ConvertError(f"{adapter_dir}: peft_type {acfg.get('peft_type')!r} is not LORA")
    if acfg.get("use_rslora"):
        raise ConvertError(f"{adapter_dir}: rsLoRA scales by alpha/sqrt(r); llama.cpp's GGUF LoRA scales "
                           "by alpha/r, so this adapter cannot be converted faithfully")
    if acfg.get("rank_pattern") or acfg.get("alpha_pattern"):
        raise ConvertError(f"{adapter_dir}: per-module rank or alpha patterns are not converted")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(acfg["lora_alpha"]))
    w.add_name(adapter_dir.name)
    for hf, ab, dtype, arr in _adapter_tensors(adapter_dir):
        name, layer, module = _gguf_name(hf)
        h = _heads(cfg, module)
        if layer is None or module.endswith("layernorm"):
            raise ConvertError(f"{adapter_dir}: LoRA on {hf} is not a projection llama.cpp adapts")
        if ab == "b" and h is not None:
            arr = _permute(arr, h)
        w.add_tensor(f"{name}.lora_{ab}", np.ascontiguousarray(_float32(dtype, arr)))
    _finish(w)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("model", help="a transformers Llama checkpoint directory")
    m.add_argument("model_dir", type=Path)
    m.add_argument("out", type=Path)
    m.add_argument("--type", choices=TYPES, default="f32")
    a = sub.add_parser("adapter", help="a PEFT LoRA adapter directory")
    a.add_argument("adapter_dir", type=Path)
    a.add_argument("model_dir", type=Path)
    a.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.what == "model":
            print(convert_model(args.model_dir, args.out, args.type))
        else:
            print(convert_adapter(args.adapter_dir, args.model_dir, args.out))
    except (ConvertError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"gguf_convert: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
