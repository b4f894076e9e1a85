"""The weight-dtype axis of `kvmesh bench accuracy`: perplexity on the bench text with the model's
weights in each format, against fp32 weights, and (with `--llama-cpp DIR`) against llama.cpp's
`llama-perplexity` on the GGUF of the same format, text and window.

Perplexity here follows llama-perplexity's protocol so that the two figures compare: the text's
tokens in consecutive windows of `ctx` tokens (no BOS added, as the GGUF's add_bos_token says
for the default model), each window one teacher-forced prefill, and the next-token NLL counted
over the second half of each window only (positions ctx/2 .. ctx-2, each with at least ctx/2
tokens of context); ppl = exp(mean NLL over every counted position).
"""
from __future__ import annotations

import argparse
import gc
import math
from pathlib import Path
from typing import Any

WEIGHT_DTYPES = ("fp32", "bf16", "q8_0", "q4_0", "q4_1", "auto")


def windowed_ppl(engine: Any, ids: list[int], ctx: int, windows: int) -> float:
    """llama-perplexity's figure for `ids`, `windows` windows of `ctx` tokens, through `engine`."""
    import torch

    first, nll, count = ctx // 2, 0.0, 0
    for w in range(windows):
        chunk = ids[w * ctx:(w + 1) * ctx]
        logits = engine.logits(chunk)[first:ctx - 1].double()              # [ctx - 1 - first, vocab]
        target = torch.tensor(chunk[first + 1:], device=logits.device)
        nll -= float(torch.log_softmax(logits, -1).gather(1, target[:, None]).sum())
        count += ctx - 1 - first
    return math.exp(nll / count)


def bench_weight_axis(args: argparse.Namespace, text: str, text_path: Path) -> dict[str, Any]:
    from kvmesh.bench.accuracy_text import encode_text
    from worker.engine.engine import Engine, EngineConfig

    ctx = 256 if args.quick else 512
    rows: dict[str, Any] = {}
    base = 0.0
    bin_dir = getattr(args, "llama_cpp", None)
    lc_ids: list[int] | None = None
    if bin_dir is not None:   # both sides score llama.cpp's token stream (see llama_cpp.tokenize)
        from kvmesh.bench.llama_cpp import llama_tokens

        lc_ids = llama_tokens(bin_dir, args.model, text_path)
    for wd in WEIGHT_DTYPES:
        engine = Engine(EngineConfig(model=args.model, dtype="fp32", weight_dtype=wd, kv_cache_dtype="fp32",
                                     block_size=16, num_blocks=-(-ctx // 16) + 4))
        ids = lc_ids if lc_ids is not None else encode_text(engine, text)
        windows = min(len(ids) // ctx, 4 if args.quick else 16)
        if windows < 2:
            from contracts.cli import CLIError
            raise CLIError(f"--text: {text_path} has {len(ids)} tokens; the weight axis needs {2 * ctx}")
        ppl = windowed_ppl(engine, ids, ctx, windows)
        base = base or ppl
        rows[wd] = {"ppl": ppl, "ppl_delta_frac": ppl / base - 1, "weight_format": engine.runner.weight_format,
                    "weight_bytes": engine.runner.weight_bytes}
        if bin_dir is not None and wd != "bf16":
            from kvmesh.bench.llama_cpp import llama_perplexity

            lc = llama_perplexity(bin_dir, args.model, wd, text_path, ctx, windows, engine.cfg.threads or _threads())
            rows[wd] |= {"llama_cpp_ppl": lc, "vs_llama_cpp_frac": ppl / lc - 1}
        del engine
        gc.collect()
    return {**rows, "notes": {
        "ppl": f"llama-perplexity's protocol over {ctx}-token windows of the text (at most {4 if args.quick else 16}): "
               "next-token NLL over the second half of each window, teacher-forced, fp32 activations and KV "
               "(Q8_0 / Q4_* linears take their input quantized to int8 per block of 32, as llama.cpp's)",
        "tokens": "with --llama-cpp, the text's tokens by llama.cpp's tokenizer (llama-tokenize) on both sides, "
                  "the stream llama-perplexity scores; else the model's HF tokenizer",
        "ppl_delta_frac": "ppl / ppl with fp32 weights - 1",
        "auto": "the checkpoint's own format (the shipped GGUF: Q4_1 layers, Q8_0 embedding and tied LM head)",
        "llama_cpp_ppl": "--llama-cpp: llama-perplexity -c <window> --chunks <windows> on the GGUF of the same "
                         "weights (auto: the checkpoint itself; a named format: llama-quantize --allow-requantize "
                         "--pure of it, embedding and output in that format too), same text and threads; "
                         "vs_llama_cpp_frac = ppl / llama_cpp_ppl - 1"}}


def _threads() -> int:
    import torch
    return torch.get_num_threads()
