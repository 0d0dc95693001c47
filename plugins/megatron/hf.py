"""Megatron-core GPT / Llama <-> Hugging Face Llama: the mapping rules and the two conversions
``unickpt export --to hf-llama`` and ``unickpt import --to megatron`` (docs/cross-framework.md).

The names (megatron-core ShardedTensor keys as parameter names, see :mod:`unickpt.megatron.layout`;
``{i}`` the layer)::

    Hugging Face LlamaForCausalLM                     megatron-core GPTModel (SwiGLU, RMSNorm, RoPE, no bias)
    model.embed_tokens.weight                         embedding.word_embeddings.weight
    model.layers.{i}.input_layernorm.weight           decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight
    model.layers.{i}.self_attn.{q,k,v}_proj.weight    decoder.layers.{i}.self_attention.linear_qkv.weight
    model.layers.{i}.self_attn.o_proj.weight          decoder.layers.{i}.self_attention.linear_proj.weight
    model.layers.{i}.post_attention_layernorm.weight  decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight
    model.layers.{i}.mlp.{gate,up}_proj.weight        decoder.layers.{i}.mlp.linear_fc1.weight  ([gate; up])
    model.layers.{i}.mlp.down_proj.weight             decoder.layers.{i}.mlp.linear_fc2.weight
    model.norm.weight                                 decoder.final_layernorm.weight
    lm_head.weight                                    output_layer.weight  (absent when tied)

Megatron's ``linear_qkv`` interleaves heads by query group (grouped-query attention): for each of the
``G`` groups, the ``H / G`` query heads of the group, then its key head, then its value head, each
``head_dim`` rows, so that a tensor-parallel rank holds whole groups. ``q_proj`` is therefore a
``Permute`` of ``head_dim`` blocks followed by a ``Split``; in the other direction a ``Fuse`` of
``q, k, v`` followed by the inverse ``Permute``. Both rotary conventions agree (megatron-core's
default ``rotary_interleaved=False`` is Hugging Face's ``rotate_half``), so no row permutation inside a
head is needed. Tensor-parallel shards are boxes of these tensors and pipeline stages own whole
layers, so the rules never see the parallel layout: an export of a TP 2 x PP 2 checkpoint reads the
same names, and an import loads at any TP / PP.

GPT-2 is not shipped: its ``Conv1D`` weights are stored transposed, which no rule expresses.
"""
from __future__ import annotations

import io
import json
import os
import re
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CONFIG_FNAME  # megatron-core's own metadata.json

from unickpt import Fuse, Permute, Rename, Split, StateMismatchError, UnickptError, ext, interop

from .layout import SUBDIR, stored_key
from .sharded_state import OBJECT_PREFIX, KeyInfo, encode_object

__all__ = ["llama_rules", "qkv_order", "TO_HF_LLAMA", "TO_MEGATRON", "CONVERSIONS", "LINEAR_MODULES"]

LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
"""The linear layers of a megatron-core layer whose ``_extra_state`` megatron saves as a ShardedObject."""


def qkv_order(heads: int, groups: int) -> tuple[int, ...]:
    """Block order of ``[q heads; k heads; v heads]`` in megatron's ``linear_qkv`` (blocks of ``head_dim``
    rows): entry ``j`` is the megatron block holding block ``j`` of the plain concatenation. Raises
    ValueError when ``heads`` is not a multiple of ``groups``."""
    if groups < 1 or heads % groups:
        raise ValueError(f"{heads} attention heads do not form {groups} query groups")
    per = heads // groups
    q = [g * (per + 2) + j for g in range(groups) for j in range(per)]
    k = [g * (per + 2) + per for g in range(groups)]
    v = [g * (per + 2) + per + 1 for g in range(groups)]
    return tuple(q + k + v)


def llama_rules(heads: int, groups: int, head_dim: int, to: str) -> list:
    """The rules naming one side's tensors by the other's: ``to="hf"`` (Hugging Face names from megatron
    ones) or ``to="megatron"`` (the other way). Usable as ``unickpt.Mapping(llama_rules(...))``."""
    order = qkv_order(heads, groups)
    sections = (heads * head_dim, groups * head_dim, groups * head_dim)
    L, M = "model.layers.{i}.", "decoder.layers.{i}."
    pairs = [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
             ("lm_head.weight", "output_layer.weight"),
             ("model.norm.weight", "decoder.final_layernorm.weight"),
             (L + "input_layernorm.weight", M + "self_attention.linear_qkv.layer_norm_weight"),
             (L + "post_attention_layernorm.weight", M + "mlp.linear_fc1.layer_norm_weight"),
             (L + "self_attn.o_proj.weight", M + "self_attention.linear_proj.weight"),
             (L + "mlp.down_proj.weight", M + "mlp.linear_fc2.weight")]
    qkv = [L + f"self_attn.{x}_proj.weight" for x in "qkv"]
    gate_up = [L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"]
    if to == "hf":
        return ([Rename(h, m) for h, m in pairs]
                + [Split(name, "~qkv.{i}", 0, sections, j) for j, name in enumerate(qkv)]
                + [Permute("~qkv.{i}", M + "self_attention.linear_qkv.weight", 0, head_dim, order)]
                + [Split(name, M + "mlp.linear_fc1.weight", 0, 2, j) for j, name in enumerate(gate_up)])
    if to == "megatron":
        inverse = [0] * len(order)
        for j, o in enumerate(order):
            inverse[o] = j
        return ([Rename(m, h) for h, m in pairs]
                + [Permute(M + "self_attention.linear_qkv.weight", "~qkv.{i}", 0, head_dim, tuple(inverse)),
                   Fuse("~qkv.{i}", tuple(qkv), 0),
                   Fuse(M + "mlp.linear_fc1.weight", tuple(gate_up), 0)])
    raise ValueError(f"to must be 'hf' or 'megatron', got {to!r}")


def _layers(names: list[str], pattern: str) -> list[int]:
    found = {int(m.group(1)) for n in names if (m := re.match(pattern, n))}
    return sorted(found)


def _require(cfg: dict, key: str, why: str) -> Any:
    if cfg.get(key) is None:
        raise UnickptError(f"--model-config needs {key!r} ({why})")
    return cfg[key]


def _positive(cfg: dict, key: str, default: Any = None) -> int | None:
    """``cfg[key]`` as a positive int (``default`` when absent). Raises UnickptError naming the key."""
    value = cfg.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnickptError(f"model config {key!r} must be a positive integer, got {value!r}")
    return value


# the Hugging Face config.json keys an import records under these megatron names (export reads them back)
_HF_TO_MEGATRON = {"num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_query_groups",
                   "head_dim": "kv_channels", "rms_norm_eps": "layernorm_epsilon", "rope_theta": "rotary_base",
                   "max_position_embeddings": "max_position_embeddings"}


# -- megatron -> Hugging Face ------------------------------------------------------------------------
def export_hf_llama(reader: interop.StoredCheckpoint, model_config: dict) -> interop.ExportPlan:
    """The ``hf-llama`` export of a megatron-core checkpoint: every ``LlamaForCausalLM`` tensor as pieces
    of the stored ones, and ``config.json``.

    ``model_config`` (megatron's names): ``num_attention_heads`` (required), ``num_query_groups``
    (default: from the ``linear_qkv`` rows), ``kv_channels`` (default ``hidden_size /
    num_attention_heads``), ``layernorm_epsilon`` (1e-5), ``rotary_base`` (10000),
    ``max_position_embeddings`` (4096), ``torch_dtype`` (the stored dtype).

    Raises UnickptError for a missing setting, StateMismatchError for a checkpoint that is not a Llama-like
    GPT (stored tensors with no place in Llama: biases, LayerNorm biases, a non-gated MLP, MoE)."""
    if reader.meta.framework != "megatron":
        raise UnickptError(f"{reader.path!r} was written by {reader.meta.framework or 'unickpt.save'}, not megatron; "
                           "--to hf-llama exports megatron-core checkpoints")
    # what `unickpt import --to megatron` recorded from the source's config.json; --model-config overrides
    recorded = dict(((reader.meta.extra or {}).get("megatron") or {}).get("model_config") or {})
    hf_extra = recorded.pop("hf_extra", {})
    model_config = {**recorded, **model_config}
    for key in ("num_attention_heads", "num_query_groups", "kv_channels", "max_position_embeddings"):
        _positive(model_config, key)
    params = interop.StoredParams(reader.meta)
    names = params.names
    if not any(n.startswith("decoder.layers.0.mlp.linear_fc1.weight#") for n in names):
        raise StateMismatchError(f"{reader.path!r}: 'decoder.layers.*.mlp.linear_fc1.weight' is not stored as [gate; up] "
                                 "halves: not a gated (SwiGLU) MLP, which Llama needs")
    base = params.resolver()
    vocab, hidden = base("embedding.word_embeddings.weight").shape
    layers = _layers(names, r"decoder\.layers\.(\d+)\.")
    heads = int(_require(model_config, "num_attention_heads", "the stored shapes do not tell the head count"))
    head_dim = int(model_config.get("kv_channels") or hidden // heads)
    qkv_rows = base("decoder.layers.0.self_attention.linear_qkv.weight").shape[0]
    groups = int(model_config.get("num_query_groups") or (qkv_rows // head_dim - heads) // 2)
    if (heads + 2 * groups) * head_dim != qkv_rows:
        raise StateMismatchError(f"{reader.path!r}: linear_qkv has {qkv_rows} rows, not (heads {heads} + 2 x groups "
                                 f"{groups}) x head_dim {head_dim}; check num_attention_heads / kv_channels")
    resolve = params.resolver(llama_rules(heads, groups, head_dim, to="hf"))
    tied = "output_layer.weight" not in names
    out_names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in layers:
        out_names += [f"model.layers.{i}.{n}" for n in (
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
            "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight")]
    tensors = {}
    for n in out_names:
        try:
            tensors[n] = resolve(n)
        except KeyError as e:
            raise StateMismatchError(f"{reader.path!r}: {n!r} has no source (looked for {getattr(e, 'missing', [n])})") from None
    left = sorted(set(params.fqns) - {p.source for r in tensors.values() for p in r.pieces})
    if left:
        raise StateMismatchError(f"{reader.path!r}: stored tensors with no place in a Llama model: {left[:8]}"
                                 f"{' ...' if len(left) > 8 else ''} (biases, LayerNorm biases or other modules?)")
    ffn = tensors["model.layers.0.mlp.gate_proj.weight"].shape[0] if layers else 0
    dtype = model_config.get("torch_dtype") or tensors["model.embed_tokens.weight"].dtype
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": len(layers), "num_attention_heads": heads,
        "num_key_value_heads": groups, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": int(model_config.get("max_position_embeddings", 4096)),
        "rms_norm_eps": float(model_config.get("layernorm_epsilon", 1e-5)),
        "rope_theta": float(model_config.get("rotary_base", 10000.0)), "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": tied, "dtype": str(dtype), "torch_dtype": str(dtype)}
    for key, value in hf_extra.items():  # the source's other settings (token ids, rope scaling, ...)
        config.setdefault(key, value)
    return interop.ExportPlan(tensors=tensors, files={"config.json": (json.dumps(config, indent=2) + "\n").encode()})


# -- Hugging Face -> megatron ------------------------------------------------------------------------
def import_megatron(state: dict, model_config: dict, src: str) -> interop.ImportPlan:
    """The ``megatron`` import of a Hugging Face Llama folder ``src`` (its tensors in ``state``, its
    ``config.json`` overridden by ``model_config``): a megatron-core ``dist_checkpointing`` directory with
    the ``unickpt`` backend, exactly what :class:`~unickpt.megatron.UnickptSaveShardedStrategy` writes
    for a GPTModel with SwiGLU, RMSNorm, RoPE, no biases (``_extra_state`` of the linear layers as
    ``None``), so ``dist_checkpointing.load`` reads it at any TP / PP.

    Raises UnickptError for a missing ``config.json`` value, StateMismatchError for tensors a megatron
    GPT has no place for (biases)."""
    cfg: dict = {}
    cfg_path = os.path.join(src, "config.json") if os.path.isdir(src) else None
    if cfg_path and os.path.exists(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    cfg.update(model_config)
    if cfg.get("model_type", "llama") not in ("llama", "mistral"):
        raise UnickptError(f"{src}: model_type {cfg.get('model_type')!r} is not a Llama-like model")
    _require(cfg, "num_attention_heads", "config.json")
    _require(cfg, "hidden_size", "config.json")
    heads = _positive(cfg, "num_attention_heads")
    groups = _positive(cfg, "num_key_value_heads") or heads
    hidden = _positive(cfg, "hidden_size")
    assert heads is not None and groups is not None and hidden is not None  # required above
    head_dim = _positive(cfg, "head_dim") or hidden // heads
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    layers = _layers(list(tensors), r"model\.layers\.(\d+)\.")
    tied = bool(cfg.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"] + ([] if tied else ["output_layer.weight"])
    for i in layers:
        names += [f"decoder.layers.{i}.{n}" for n in (
            "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
            "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight")]
    resolve = interop.dict_resolver(tensors, llama_rules(heads, groups, head_dim, to="megatron"))
    out: dict[str, torch.Tensor] = {}
    infos: dict[str, KeyInfo] = {}
    used: set[str] = set()
    for name in names:
        try:
            res = resolve(name)
        except KeyError as e:
            raise StateMismatchError(f"{src}: no tensor for megatron's {name!r} (looked for "
                                     f"{getattr(e, 'missing', [name])})") from None
        used.update(res.sources)
        value = interop.materialize(res, interop.box_of(tensors), tensors[res.sources[0]].dtype)
        key, idx = stored_key(name)
        fqn = key + (f"[{idx[0]}]" if idx else "")
        split = (0, 2) if name.endswith("mlp.linear_fc1.weight") else None
        if split is None:
            out[fqn] = value
        else:
            for s, half in enumerate(torch.chunk(value, 2, dim=0)):
                out[f"{fqn}#{s}/2"] = half.contiguous()
        info = KeyInfo(((len(layers),) if idx else ()) + tuple(value.shape), ext.Codec.dtype_to_str(value.dtype),
                       1 if idx else 0, split)
        infos.setdefault(key, info)
    left = sorted(set(tensors) - used - {"lm_head.weight"} if tied else set(tensors) - used)
    left = [n for n in left if not n.endswith("rotary_emb.inv_freq")]
    if left:
        raise StateMismatchError(f"{src}: tensors with no place in a megatron-core GPT (SwiGLU, RMSNorm, no bias): "
                                 f"{left[:8]}{' ...' if len(left) > 8 else ''}")
    for i in layers:  # the ShardedObjects megatron-core's local linear layers save (their extra state is None)
        for module in LINEAR_MODULES:
            unique = f"decoder.layers.{module}._extra_state/shard_{i}_{len(layers)}"
            out[OBJECT_PREFIX + unique] = encode_object(None, unique, allow_pickle=False)
    recorded = {meg: cfg[hf] for hf, meg in _HF_TO_MEGATRON.items() if cfg.get(hf) is not None}
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta")  # transformers >= 5 keeps it there
    if rope is not None:
        recorded.setdefault("rotary_base", rope)
    recorded.setdefault("num_query_groups", groups)
    recorded["hf_extra"] = {k: v for k, v in cfg.items() if k not in _HF_TO_MEGATRON and isinstance(
        v, (str, int, float, bool, list, dict, type(None)))}
    extra = {"megatron": {"backend": "unickpt", "backend_version": 1, "object_prefix": OBJECT_PREFIX,
                          "keys": {k: v.to_json() for k, v in sorted(infos.items())},
                          "model_config": recorded}}
    common = io.BytesIO()
    torch.save({}, common)
    outer = {"sharded_backend": "unickpt", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}
    return interop.ImportPlan(state=out, framework="megatron", extra=extra, subdir=SUBDIR,
                      files={"common.pt": common.getvalue(), CONFIG_FNAME: json.dumps(outer).encode()})


def _conversions() -> list[interop.Conversion]:
    Conversion = interop.Conversion
    return [Conversion("hf-llama", "export", "a megatron-core GPT / Llama checkpoint as a Hugging Face Llama folder",
                       export_hf_llama),
            Conversion("megatron", "import", "a Hugging Face Llama folder as a megatron-core dist_checkpointing "
                       "directory (unickpt backend)", import_megatron)]


CONVERSIONS = _conversions()
TO_HF_LLAMA, TO_MEGATRON = CONVERSIONS
