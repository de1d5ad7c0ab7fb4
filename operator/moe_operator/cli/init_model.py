"""moectl init-model: a small random checkpoint of a supported family."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from .console import app, err, fail, out


@app.command("init-model")
def init_model(
    directory: Path = typer.Argument(..., help="Where to write the checkpoint (Hugging Face layout)."),
    family: str = typer.Option("mixtral", "--family", help="Model family (config.json model_type): mixtral, "
                               "qwen3_moe, qwen2_moe, olmoe, deepseek_v3, deepseek_v2 or gpt_oss."),
    shape: str = typer.Option("", "--shape", help="A published model's dimensions (mixtral-8x7b, qwen3-30b-a3b, "
                              "deepseek-v3, gpt-oss-20b, gpt-oss-120b): sets the family and every dimension "
                              "but --layers (all MoE layers) and --experts (default: the published count)."),
    layers: int = typer.Option(2, min=1, help="Decoder layers."),
    experts: int = typer.Option(None, min=1, help="Experts per layer (default 8, or the --shape's count)."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts per token."),
    hidden: int = typer.Option(64, min=8, help="Hidden size."),
    intermediate: int = typer.Option(128, min=8, help="Expert intermediate size."),
    heads: int = typer.Option(4, min=1, help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (grouped-query attention)."),
    max_len: int = typer.Option(512, "--max-len", min=16, help="max_position_embeddings."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    seed: int = typer.Option(0, help="Random seed."),
    quantize: str = typer.Option("", "--quantize", help="Write the layout a quantized release ships: fp8 "
                                 "(block-scaled F8_E4M3, as DeepSeek-V3 and Qwen3 -FP8) or mxfp4 (gpt_oss experts)."),
    block_size: int = typer.Option(128, "--block-size", min=1, help="fp8: weight_block_size (square blocks)."),
    scale_dtype: str = typer.Option("float32", "--scale-dtype", help="fp8: the scales' dtype (DeepSeek float32, "
                                    "Qwen3 bfloat16)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing checkpoint."),
):
    """Write a random MoE checkpoint of a family (config.json, safetensors in the layout
    transformers writes, byte-level tokenizer.json, tokenizer_config.json with a simple chat template);
    with --quantize, in the layout of the family's quantized release."""
    import torch

    from moe_workers.model.dtypes import COMPUTE
    from moe_workers.model import published
    from moe_workers.model.family import SUPPORTED
    from moe_workers.model.quantization import FP8, MXFP4, MXFP4_GROUP
    from moe_workers.model.random_init import write_random_checkpoint
    from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
    from moe_workers.serve.openai.chat import write_tokenizer_config

    dtypes = {name: getattr(torch, name) for name in COMPUTE}
    if dtype not in dtypes:
        fail(f"--dtype {dtype!r} is not one of {', '.join(dtypes)}", 2)
    fields = None
    if shape:
        if shape not in published.SHAPES:
            fail(f"--shape {shape!r} is not one of {', '.join(published.SHAPES)}", 2)
        try:
            fields = published.overrides(shape, num_layers=layers, num_experts=experts)
        except ValueError as problem:
            fail(f"--experts: {problem}", 2)
        family = published.family_of(shape)
        experts = experts or published.expert_count(shape)
        top_k, hidden = fields["num_experts_per_tok"], fields["hidden_size"]
        heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
        intermediate = fields.get("moe_intermediate_size", fields["intermediate_size"])
    experts = experts or 8
    if family not in SUPPORTED:
        fail(f"--family {family!r} is not one of {', '.join(SUPPORTED)}", 2)
    if top_k > experts:
        fail(f"--top-k {top_k} is larger than --experts {experts}", 2)
    if not shape and (hidden % heads or heads % kv_heads):
        fail("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads", 2)
    if quantize not in ("", FP8, MXFP4):
        fail(f"--quantize {quantize!r} is not one of {FP8}, {MXFP4}", 2)
    if quantize == MXFP4 and family != "gpt_oss":
        fail(f"--quantize mxfp4 is the gpt_oss format (--family {family}: use fp8)", 2)
    if quantize == MXFP4 and (hidden % MXFP4_GROUP or intermediate % MXFP4_GROUP):
        fail(f"--quantize mxfp4 needs --hidden and --intermediate multiples of {MXFP4_GROUP}", 2)
    if scale_dtype not in dtypes:
        fail(f"--scale-dtype {scale_dtype!r} is not one of {', '.join(dtypes)}", 2)
    if (directory / "config.json").exists() and not force:
        out.print(f"{directory} already holds a checkpoint (use --force to overwrite)")
        return
    with Progress(TextColumn("writing layers"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err) as progress:
        task = progress.add_task("layers", total=layers)
        write_random_checkpoint(directory, family, vocab_size=BYTE_VOCAB_SIZE, hidden_size=hidden,
                                intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                                num_kv_heads=kv_heads, num_experts=experts, top_k=top_k,
                                max_position_embeddings=max_len, dtype=dtypes[dtype], seed=seed, router_scale=10.0,
                                progress=lambda done, total: progress.update(task, completed=done),
                                quantize=quantize or None, block=(block_size, block_size),
                                scale_dtype=dtypes[scale_dtype], overrides=fields)
    write_byte_tokenizer(directory)
    write_tokenizer_config(directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    form = (f", {shape} dimensions" if shape else "") + (f", {quantize}" if quantize else "")
    out.print(f"wrote {directory} ({family}{form}, {layers} layers x {experts} experts, top-{top_k}, "
              f"{size / 2**20:.1f} MiB)")
