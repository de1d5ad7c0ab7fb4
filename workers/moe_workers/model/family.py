"""The MoE model families we serve, read from a Hugging Face config.json (pure: no torch).

One `Arch` holds everything the dense part and the experts need to compute a family the way
transformers does: which layers route to experts (the others run a dense MLP in the ingress),
the router (softmax top-k, top-k then softmax, or DeepSeek's sigmoid scores with group-limited
top-k), shared experts (computed in the ingress beside the routed ones), the attention variant
(q/k norms, biases, sinks, sliding windows, multi-head latent attention), rope scaling, and the
expert's tensors (their names on disk, per expert or fused over a layer, and their shapes).

The operator reads it too (it has no torch): the layers and experts that exist, an expert's
bytes, and the tensors a checkpoint must hold, checked against the safetensors headers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .dtypes import BYTES, COMPUTE, FLOAT_SAFETENSORS
from .quantization import (FP8, FP8_DTYPE, MXFP4, SCALE_DTYPES, U8, Quantization, QuantizationError,
                           check_fp8_weight, mxfp4_shapes, parse_quantization, scale_name)

class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is; the message says what is wrong and where."""


class UnsupportedModel(CheckpointError):
    """A model_type (or a quantization, or an option of a family) we cannot compute yet."""


@dataclass(frozen=True)
class Arch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # one routed expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype_name: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a sequence (the first is eos_token_id)
    family: str = "mixtral"
    moe_layers: tuple[int, ...] | None = None  # None: every layer
    dense_intermediate_size: int = 0  # the MLP of layers without experts
    shared_intermediate_size: int = 0  # shared expert(s), 0: none
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate(x)) scales the shared expert
    router: str = "softmax"  # softmax | topk_softmax (gpt_oss) | sigmoid_group (deepseek_v3) | softmax_group (deepseek_v2)
    norm_topk_prob: bool = True
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    qk_norm: str = ""  # "" | head (qwen3_moe) | full (olmoe)
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # per layer: full_attention | sliding_attention
    rope: tuple = ()  # rope_parameters beyond theta, as sorted (key, value) pairs (yarn)
    rope_interleave: bool = False
    q_lora_rank: int = 0  # multi-head latent attention (deepseek_v3); kv_lora_rank 0: plain attention
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    expert_act: str = "silu"  # silu (SwiGLU) | gpt_oss (clamped SwiGLU with biases)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_layout: str = "mixtral"  # mixtral | hf (mlp.experts.E.*_proj) | fused (gpt_oss)
    quant: Quantization | None = None  # the checkpoint's quantization_config (None: plain weights)

    # -- what exists ---------------------------------------------------------------------------

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers)) if self.moe_layers is None else self.moe_layers

    def is_sparse(self, layer: int) -> bool:
        return self.moe_layers is None or layer in self.moe_layers

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_params(self) -> dict:
        return dict(self.rope)

    def sliding(self, layer: int) -> int | None:
        """The window of `layer` when it attends to a sliding window, else None."""
        if self.sliding_window and self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    # -- experts --------------------------------------------------------------------------------

    def expert_parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """One routed expert's tensors as the store keeps them: (name, shape), sorted by name
        (the order of a slot and of a cold-cache file)."""
        h, i = self.hidden_size, self.intermediate_size
        if self.experts_out_in:  # gpt_oss decoded from mxfp4's [out, in]
            return (("down", (h, i)), ("down_bias", (h,)), ("gate_up", (2 * i, h)), ("gate_up_bias", (2 * i,)))
        if self.expert_act == "gpt_oss":  # transformers' layout: x @ gate_up (interleaved), @ down
            return (("down", (i, h)), ("down_bias", (h,)), ("gate_up", (h, 2 * i)), ("gate_up_bias", (2 * i,)))
        return (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h)))

    @property
    def experts_out_in(self) -> bool:
        """Whether the routed experts' compute layout is [out, in] (mxfp4 gpt_oss: decoded as the
        blocks are stored, the layout a decode step's matrix-vector product reads in one pass,
        26-28 GB/s here against 10-12 for x @ W in transformers' [in, out]; bench/realshape.py
        --only kernels) rather than the checkpoint's own."""
        return self.expert_act == "gpt_oss" and self.quant is not None and self.quant.method == MXFP4

    def release_parts(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """One expert's parts as the family's unquantized release lays them out (transformers'
        gpt_oss [in, out]): the checkpoint's tensors, and a hot-swap file in the compute dtype;
        `from_release_layout` turns them into the compute layout."""
        if not self.experts_out_in:
            return self.expert_parts()
        return tuple((n, tuple(reversed(shape))) for n, shape in self.expert_parts())

    def from_release_layout(self, tensors: dict) -> dict:
        if not self.experts_out_in:
            return tensors
        return {n: t.t().contiguous() if t.dim() == 2 else t for n, t in tensors.items()}

    def expert_numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.expert_parts())

    def expert_bytes(self, dtype_name: str | None = None) -> int:
        return self.expert_numel() * BYTES[dtype_name or self.dtype_name]

    def stored_parts(self, scale_dtype: str = "F32") -> tuple[tuple[str, str | None, tuple[int, ...]], ...]:
        """One routed expert's tensors as the checkpoint stores them: (name, safetensors dtype or
        None for the checkpoint's float dtype, shape), sorted by name. Unquantized: the compute
        parts; fp8: each part F8_E4M3 and its `<part>.scale_inv` grid (`scale_dtype`, from the
        header); mxfp4: gate_up / down as `_blocks` and `_scales` ([out, in/32, 16] and
        [out, in/32] of the [out, in] matrix), biases as they are."""
        if self.quant is None:
            return tuple((name, None, shape) for name, shape in self.expert_parts())
        out = []
        for name, shape in self.expert_parts():
            if self.quant.method == FP8:
                out += [(name, FP8_DTYPE, shape), (name + ".scale_inv", scale_dtype, self.quant.grid(shape))]
            elif name.endswith("_bias"):
                out.append((name, None, shape))
            else:  # compute layout [out, in] (experts_out_in); the blocks run along in
                blocks, scales = mxfp4_shapes(shape[0], shape[1])
                out += [(name + "_blocks", U8, blocks), (name + "_scales", U8, scales)]
        return tuple(sorted(out))

    def stored_sources(self, layer: int, expert: int) -> list[tuple[str, str, int | None]]:
        """(stored part, checkpoint tensor, index into its first dimension or None) of one
        expert, in `stored_parts()` order."""
        sources = self.expert_sources(layer, expert)
        if self.quant is None:
            return sources
        out = []
        for part, name, index in sources:
            if self.quant.method == FP8:
                out += [(part, name, index), (part + ".scale_inv", scale_name(name), index)]
            elif part.endswith("_bias"):
                out.append((part, name, index))
            else:
                out += [(part + "_blocks", name + "_blocks", index), (part + "_scales", name + "_scales", index)]
        return sorted(out)

    def expert_sources(self, layer: int, expert: int) -> list[tuple[str, str, int | None]]:
        """(part, checkpoint tensor, index into its first dimension or None) of one expert, as
        an unquantized checkpoint names it (`stored_sources`: as this one stores it)."""
        if self.expert_layout == "fused":
            p = f"model.layers.{layer}.mlp.experts."
            names = {"down": "down_proj", "down_bias": "down_proj_bias", "gate_up": "gate_up_proj",
                     "gate_up_bias": "gate_up_proj_bias"}
            return [(part, p + names[part], expert) for part, _ in self.expert_parts()]
        if self.expert_layout == "hf":
            p = f"model.layers.{layer}.mlp.experts.{expert}."
            return [("w1", p + "gate_proj.weight", None), ("w2", p + "down_proj.weight", None),
                    ("w3", p + "up_proj.weight", None)]
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return [(w, p + f"{w}.weight", None) for w in ("w1", "w2", "w3")]

    def stored_aliases(self) -> dict[str, tuple[str, ...]]:
        """`swap_aliases` for each stored part of a quantized expert (w1.scale_inv:
        gate_proj.weight_scale_inv, ...; gate_up_blocks: gate_up_proj_blocks)."""
        plain = self.swap_aliases()
        out = {}
        for part, _, _ in self.stored_parts():
            base, _, kind = part.partition(".")
            if kind == "scale_inv":
                out[part] = tuple(scale_name(a) for a in plain[base])
            elif part.endswith(("_blocks", "_scales")):
                base, suffix = part.rsplit("_", 1)
                out[part] = tuple(f"{a}_{suffix}" for a in plain[base])
            else:
                out[part] = plain[part]
        return out

    def swap_aliases(self) -> dict[str, tuple[str, ...]]:
        """Short tensor names a hot-swap file may use for each part (besides the checkpoint's)."""
        if self.expert_act == "gpt_oss":
            return {"down": ("down_proj",), "down_bias": ("down_proj_bias",), "gate_up": ("gate_up_proj",),
                    "gate_up_bias": ("gate_up_proj_bias",)}
        if self.expert_layout == "hf":
            return {"w1": ("gate_proj.weight", "w1.weight"), "w2": ("down_proj.weight", "w2.weight"),
                    "w3": ("up_proj.weight", "w3.weight")}
        return {w: (f"{w}.weight",) for w in ("w1", "w2", "w3")}

    def expert_problem(self, layer: int, expert: int) -> str | None:
        """Why `L.E` names no routed expert of this model, or None."""
        if not 0 <= layer < self.num_layers:
            return f"expert {layer}.{expert} does not exist (the model has layers 0..{self.num_layers - 1})"
        if not self.is_sparse(layer):
            return (f"expert {layer}.{expert} does not exist: layer {layer} of this {self.family} model is a "
                    f"dense MLP layer (no routed experts; sparse layers: {_ranges(self.sparse_layers)})")
        if not 0 <= expert < self.num_experts:
            return f"expert {layer}.{expert} does not exist ({self.num_experts} routed experts per layer: 0..{self.num_experts - 1})"
        return None

    # -- the checkpoint's tensors ---------------------------------------------------------------

    def layer_tensors(self, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The dense tensors of one decoder layer, by the role the dense model gives them: role ->
        (checkpoint name, shape). The one place these names are written: the checker
        (`tensor_shapes`) and the loader (`model/dense.py`) both read them here. Roles: in_norm,
        post_norm; attention q, k, v, o (+ _bias), q_norm, k_norm, sinks, or latent q_a, q_a_norm,
        q_b (or q), kv_a, kv_a_norm, kv_b; a MoE layer's router gate (+ gate_bias, correction)
        and shared expert shared.gate / shared.up / shared.down (+ shared_gate); a dense layer's
        mlp.gate / mlp.up / mlp.down."""
        h, p = self.hidden_size, f"model.layers.{layer}."
        a = p + "self_attn."
        out = {"in_norm": (p + "input_layernorm.weight", (h,)), "post_norm": (p + "post_attention_layernorm.weight", (h,))}
        out.update({role: (a + name, shape) for role, (name, shape) in self._attention_tensors().items()})
        if self.is_sparse(layer):
            out.update({role: (p + name, shape) for role, (name, shape) in self._router_tensors().items()})
        else:
            out.update(_mlp_tensors("mlp", p + "mlp.", h, self.dense_intermediate_size))
        return out

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape (experts included)."""
        h, out = self.hidden_size, {}
        out["model.embed_tokens.weight"] = (self.vocab_size, h)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            out.update(dict(self.layer_tensors(layer).values()))
            if self.is_sparse(layer):
                for e in range(self.num_experts):
                    for part, name, index in self.expert_sources(layer, e):
                        shape = dict(self.release_parts())[part]
                        out[name] = (self.num_experts, *shape) if index is not None else shape
        return out

    def stored_shapes(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Every tensor the checkpoint must hold as it is stored: name -> (shape, safetensors
        dtype, or None for a float one). Dense weights of an fp8 checkpoint may be F8_E4M3 too
        (with their scales): `check_tensors` reads that from the headers."""
        out = {}
        for name, shape in self.tensor_shapes().items():
            out[name] = (shape, None)
        if self.quant is None:
            return out
        stored = {part: (dtype, shape) for part, dtype, shape in self.stored_parts()}
        for layer in self.sparse_layers:
            for e in range(self.num_experts):
                for _, name, _ in self.expert_sources(layer, e):
                    out.pop(name, None)
                for part, name, index in self.stored_sources(layer, e):
                    dtype, shape = stored[part]
                    if part.endswith(".scale_inv"):
                        dtype = "scale"
                    out[name] = ((self.num_experts, *shape) if index is not None else shape, dtype)
        return out

    def _attention_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        h, d, nh, kvh = self.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            out = {"kv_a": ("kv_a_proj_with_mqa.weight", (self.kv_lora_rank + self.qk_rope_head_dim, h)),
                   "kv_a_norm": ("kv_a_layernorm.weight", (self.kv_lora_rank,)),
                   "kv_b": ("kv_b_proj.weight", (nh * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)),
                   "o": ("o_proj.weight", (h, nh * self.v_head_dim))}
            if self.q_lora_rank:
                out.update({"q_a": ("q_a_proj.weight", (self.q_lora_rank, h)),
                            "q_a_norm": ("q_a_layernorm.weight", (self.q_lora_rank,)),
                            "q_b": ("q_b_proj.weight", (nh * qk, self.q_lora_rank))})
            else:
                out["q"] = ("q_proj.weight", (nh * qk, h))
            return out
        out = {"q": ("q_proj.weight", (nh * d, h)), "k": ("k_proj.weight", (kvh * d, h)),
               "v": ("v_proj.weight", (kvh * d, h)), "o": ("o_proj.weight", (h, nh * d))}
        if self.qkv_bias:
            out.update({"q_bias": ("q_proj.bias", (nh * d,)), "k_bias": ("k_proj.bias", (kvh * d,)),
                        "v_bias": ("v_proj.bias", (kvh * d,))})
        if self.o_bias:
            out["o_bias"] = ("o_proj.bias", (h,))
        if self.qk_norm == "head":
            out.update({"q_norm": ("q_norm.weight", (d,)), "k_norm": ("k_norm.weight", (d,))})
        elif self.qk_norm == "full":
            out.update({"q_norm": ("q_norm.weight", (nh * d,)), "k_norm": ("k_norm.weight", (kvh * d,))})
        if self.sinks:
            out["sinks"] = ("sinks", (nh,))
        return out

    def _router_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        h, e = self.hidden_size, self.num_experts
        if self.family == "mixtral":
            return {"gate": ("block_sparse_moe.gate.weight", (e, h))}
        if self.router == "topk_softmax":
            return {"gate": ("mlp.router.weight", (e, h)), "gate_bias": ("mlp.router.bias", (e,))}
        out = {"gate": ("mlp.gate.weight", (e, h))}
        if self.router == "sigmoid_group":
            out["correction"] = ("mlp.gate.e_score_correction_bias", (e,))
        if self.shared_intermediate_size:
            name = "mlp.shared_expert." if self.shared_gate else "mlp.shared_experts."
            out.update(_mlp_tensors("shared", name, h, self.shared_intermediate_size))
            if self.shared_gate:
                out["shared_gate"] = ("mlp.shared_expert_gate.weight", (1, h))
        return out

    def check_tensors(self, index: dict[str, tuple[str, str, tuple[int, ...]]], where: str) -> None:
        """Refuse a checkpoint whose tensors contradict this config. `index`: name -> (file,
        safetensors dtype, shape), read from the headers only. Quantized tensors are checked
        against their format (fp8: each F8_E4M3 weight with its scale grid; mxfp4: the experts'
        blocks and scales as U8)."""
        try:
            for name, (shape, want) in self.stored_shapes().items():
                got = index.get(name)
                if got is None:
                    raise CheckpointError(f"{where}: tensor {name} is missing (config.json describes a "
                                          f"{self.family} model{_quant_words(self.quant)} that needs it)")
                file, dtype, actual = got
                if tuple(actual) != tuple(shape):
                    raise CheckpointError(f"{file}: tensor {name} has shape {tuple(actual)}, config.json implies "
                                          f"{tuple(shape)}")
                if want == "scale":
                    if dtype not in SCALE_DTYPES:
                        raise CheckpointError(f"{file}: tensor {name} is {dtype}; fp8 scales are F32, BF16 or F16")
                elif want is not None and dtype != want:
                    raise CheckpointError(f"{file}: tensor {name} is {dtype}; a{_quant_words(self.quant)} "
                                          f"checkpoint stores it as {want}")
                elif want is None and dtype == FP8_DTYPE:
                    check_fp8_weight(index, name, self.quant)
                elif want is None and dtype not in FLOAT_SAFETENSORS:
                    raise UnsupportedModel(f"{file}: tensor {name} is {dtype}; only F32, BF16 and F16 weights are "
                                           f"read here (and fp8 / mxfp4 as their quantization_config declares)")
        except QuantizationError as err:
            raise CheckpointError(str(err)) from None


def _quant_words(quant: Quantization | None) -> str:
    return f" ({quant.method})" if quant is not None else ""


def _mlp_tensors(role: str, prefix: str, h: int, i: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A SwiGLU MLP's three projections: <role>.gate / .up / .down."""
    return {f"{role}.gate": (prefix + "gate_proj.weight", (i, h)), f"{role}.up": (prefix + "up_proj.weight", (i, h)),
            f"{role}.down": (prefix + "down_proj.weight", (h, i))}


def _ranges(layers: tuple[int, ...]) -> str:
    if not layers:
        return "none"
    spans, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + (None,)):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(spans)


# -- config.json ---------------------------------------------------------------------------------

def parse(raw: dict, source: str = "config.json", family: str | None = None) -> Arch:
    """The Arch of a config.json; `family` overrides its model_type (spec.model.family)."""
    model_type = family or raw.get("model_type")
    if model_type not in SUPPORTED:
        raise UnsupportedModel(f"{source}: model_type {model_type!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED)})")
    try:
        quant = parse_quantization(raw.get("quantization_config"), model_type, source)
    except QuantizationError as err:
        raise UnsupportedModel(str(err)) from None
    try:
        arch = _PARSERS[model_type](raw, {**_common(raw), "quant": quant})
    except KeyError as err:
        raise CheckpointError(f"{source}: missing {err.args[0]}") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{source}: {err}") from None
    _check(arch, raw, source)
    return arch


def _common(raw: dict) -> dict:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    eos = raw.get("eos_token_id")
    return dict(
        vocab_size=int(raw["vocab_size"]), hidden_size=hidden, num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), top_k=int(raw["num_experts_per_tok"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        dtype_name=str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch."),
        bos_token_id=raw.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
        eos_token_ids=token_ids(eos, "eos_token_id"),
        rope=tuple(sorted((k, v) for k, v in rope.items() if k != "type")),
    )


def token_ids(value, field: str) -> tuple[int, ...]:
    """A config's token id field, one id or a list of them (as config.json and
    generation_config.json write eos_token_id), as a tuple; None: none."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{field} must be a token id or a list of them, not {value!r}")
    return tuple(ids)


def eos_outside_vocabulary(ids: tuple[int, ...], vocab_size: int) -> str | None:
    """What is wrong with end-of-sequence ids a model cannot produce, or None."""
    if any(i >= vocab_size for i in ids):
        return f"eos_token_id {list(ids)} names an id outside the vocabulary of {vocab_size}"
    return None


def _mixtral(raw: dict, c: dict) -> Arch:
    return Arch(**c, family="mixtral", intermediate_size=int(raw["intermediate_size"]),
                num_experts=int(raw["num_local_experts"]), sliding_window=raw.get("sliding_window"),
                layer_types=("full_attention",) * c["num_layers"] if not raw.get("sliding_window") else
                ("sliding_attention",) * c["num_layers"])


def _sparse_steps(raw: dict, layers: int) -> tuple[int, ...]:
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    only_dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i for i in range(layers) if i not in only_dense and (i + 1) % step == 0)


def _qwen_sliding(raw: dict, layers: int) -> tuple[tuple[str, ...] | None, int | None]:
    if not raw.get("use_sliding_window"):
        return None, None
    types = raw.get("layer_types") or ["sliding_attention"] * layers
    return tuple(types), raw.get("sliding_window")


def _qwen3_moe(raw: dict, c: dict) -> Arch:
    types, window = _qwen_sliding(raw, c["num_layers"])
    return Arch(**c, family="qwen3_moe", expert_layout="hf", intermediate_size=int(raw["moe_intermediate_size"]),
                num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
                dense_intermediate_size=int(raw["intermediate_size"]), moe_layers=_sparse_steps(raw, c["num_layers"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), qk_norm="head",
                qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
                layer_types=types, sliding_window=window)


def _qwen2_moe(raw: dict, c: dict) -> Arch:
    types, window = _qwen_sliding(raw, c["num_layers"])
    return Arch(**c, family="qwen2_moe", expert_layout="hf", intermediate_size=int(raw["moe_intermediate_size"]),
                num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
                dense_intermediate_size=int(raw["intermediate_size"]), moe_layers=_sparse_steps(raw, c["num_layers"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                shared_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0), shared_gate=True,
                qkv_bias=bool(raw.get("qkv_bias", True)), layer_types=types, sliding_window=window)


def _olmoe(raw: dict, c: dict) -> Arch:
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModel("olmoe with clip_qkv is not supported yet")
    return Arch(**c, family="olmoe", expert_layout="hf", intermediate_size=int(raw["intermediate_size"]),
                num_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), qk_norm="full",
                qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)))


def _deepseek_v3(raw: dict, c: dict, family: str = "deepseek_v3") -> Arch:
    if raw.get("attention_bias"):
        raise UnsupportedModel(f"{family} with attention_bias is not supported yet")
    layers = c["num_layers"]
    first_dense = int(raw.get("first_k_dense_replace", 0))
    c = {**c, "head_dim": int(raw["qk_rope_head_dim"])}  # rope runs over the decoupled rope dims
    if family == "deepseek_v2":  # softmax scores; greedy or group-limited (max per group) top-k; no renormalisation
        method = raw.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModel(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
        routing = dict(router="softmax_group", norm_topk_prob=False,
                       n_group=int(raw.get("n_group") or 1) if method == "group_limited_greedy" else 1,
                       topk_group=int(raw.get("topk_group") or 1) if method == "group_limited_greedy" else 1)
    else:
        routing = dict(router="sigmoid_group", norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
                       n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1))
    return Arch(**c, **routing, family=family, expert_layout="hf", intermediate_size=int(raw["moe_intermediate_size"]),
                num_experts=int(raw.get("n_routed_experts") or raw["num_local_experts"]),
                dense_intermediate_size=int(raw["intermediate_size"]),
                moe_layers=tuple(range(first_dense, layers)),
                shared_intermediate_size=int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                q_lora_rank=int(raw.get("q_lora_rank") or 0), kv_lora_rank=int(raw["kv_lora_rank"]),
                qk_nope_head_dim=int(raw["qk_nope_head_dim"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                v_head_dim=int(raw["v_head_dim"]), rope_interleave=bool(raw.get("rope_interleave", True)))


def _gpt_oss(raw: dict, c: dict) -> Arch:
    layers = c["num_layers"]
    types = tuple(raw.get("layer_types") or
                  ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])
    return Arch(**c, family="gpt_oss", expert_layout="fused", intermediate_size=int(raw["intermediate_size"]),
                num_experts=int(raw["num_local_experts"]), router="topk_softmax", router_bias=True,
                qkv_bias=bool(raw.get("attention_bias", True)), o_bias=bool(raw.get("attention_bias", True)),
                sinks=True, sliding_window=int(raw.get("sliding_window") or 128), layer_types=types,
                expert_act="gpt_oss", swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(raw.get("swiglu_limit", 7.0)))


_PARSERS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "olmoe": _olmoe,
            "deepseek_v3": _deepseek_v3, "deepseek_v2": lambda raw, c: _deepseek_v3(raw, c, "deepseek_v2"),
            "gpt_oss": _gpt_oss}
SUPPORTED = tuple(_PARSERS)  # the families we read: the API's Literal is tested against it (test_families)


def _check(a: Arch, raw: dict, source: str) -> None:
    if a.dtype_name not in COMPUTE:
        raise CheckpointError(f"{source}: dtype {a.dtype_name!r} is not supported (float32, bfloat16, float16)")
    if not 1 <= a.top_k <= a.num_experts:
        raise CheckpointError(f"{source}: num_experts_per_tok ({a.top_k}) must be between 1 and the number of "
                              f"routed experts ({a.num_experts})")
    if a.num_heads % a.num_kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads ({a.num_heads}) is not a multiple of "
                              f"num_key_value_heads ({a.num_kv_heads})")
    if not a.sparse_layers:
        raise CheckpointError(f"{source}: no layer has routed experts (check decoder_sparse_step, mlp_only_layers "
                              f"or first_k_dense_replace): this is not a mixture-of-experts model")
    problem = eos_outside_vocabulary(a.eos_token_ids, a.vocab_size)
    if problem:
        raise CheckpointError(f"{source}: {problem}")
    if a.layer_types is not None and len(a.layer_types) != a.num_layers:
        raise CheckpointError(f"{source}: layer_types has {len(a.layer_types)} entries for {a.num_layers} layers")
    if a.router in ("sigmoid_group", "softmax_group") and (a.num_experts % a.n_group or a.topk_group > a.n_group):
        raise CheckpointError(f"{source}: n_routed_experts ({a.num_experts}) must divide into n_group ({a.n_group}) "
                              f"groups, with topk_group ({a.topk_group}) <= n_group")
    if a.quant is not None:
        try:
            a.stored_parts()
        except QuantizationError as err:
            raise CheckpointError(f"{source}: {err}") from None
    rope_type = a.rope_params.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise UnsupportedModel(f"{source}: rope_type {rope_type!r} is not supported (supported: default, yarn)")
