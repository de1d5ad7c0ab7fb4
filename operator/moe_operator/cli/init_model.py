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
    layers: int = typer.Option(2, min=1, help="Decoder layers."),
    experts: int = typer.Option(8, min=1, help="Experts per layer."),
    top_k: int = typer.Option(2, "--top-k", min=1, help="Experts per token."),
    hidden: int = typer.Option(64, min=8, help="Hidden size."),
    intermediate: int = typer.Option(128, min=8, help="Expert intermediate size."),
    heads: int = typer.Option(4, min=1, help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", min=1, help="Key/value heads (grouped-query attention)."),
    max_len: int = typer.Option(512, "--max-len", min=16, help="max_position_embeddings."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16."),
    seed: int = typer.Option(0, help="Random seed."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing checkpoint."),
):
    """Write a small random MoE checkpoint of a family (config.json, safetensors in the layout
    transformers writes, byte-level tokenizer.json, tokenizer_config.json with a simple chat template)."""
    import torch

    from moe_workers.model.family import SUPPORTED
    from moe_workers.model.random_init import write_random_checkpoint
    from moe_workers.model.tokenizer import BYTE_VOCAB_SIZE, write_byte_tokenizer
    from moe_workers.serve.chat import write_tokenizer_config

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        fail(f"--dtype {dtype!r} is not one of {', '.join(dtypes)}", 2)
    if family not in SUPPORTED:
        fail(f"--family {family!r} is not one of {', '.join(SUPPORTED)}", 2)
    if top_k > experts:
        fail(f"--top-k {top_k} is larger than --experts {experts}", 2)
    if hidden % heads or heads % kv_heads:
        fail("--hidden must be a multiple of --heads, and --heads a multiple of --kv-heads", 2)
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
                                progress=lambda done, total: progress.update(task, completed=done))
    write_byte_tokenizer(directory)
    write_tokenizer_config(directory)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    out.print(f"wrote {directory} ({family}, {layers} layers x {experts} experts, top-{top_k}, {size / 2**20:.1f} MiB)")
