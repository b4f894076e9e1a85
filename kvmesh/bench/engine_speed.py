"""`kvmesh bench engine`: kvmesh vs HF transformers `generate`, and the rooflines of the same run.

Machine figures: a read-only stream (decode only reads weights), a copy (read + write bytes),
and an n³ matmul (fp32 on CPU, bf16 on GPU). Model figures: the weight bytes a decode step
reads and the flops a token costs, from the engine's own model (the weights its linear layers
hold, the attention shape of its config). From both:
- batch-1 decode: min(read bandwidth / weight bytes, matmul flops / decode flops per token);
- a batch workload (prompts + outputs of given lengths): its prefill at matmul speed, then each
  decode step as the slower of one weight read and its rows' flops;
- prefill: the flops of a cold prompt over the matmul peak.
Best of several repetitions for every machine figure (a busy machine only slows them down).
"""
from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


class MachineSpeed(NamedTuple):
    read_gb_s: float        # sum() of a tensor beyond any cache
    copy_gb_s: float        # copy_(): read + write bytes
    matmul_gflop_s: float   # an n³ matmul


class ModelCost(NamedTuple):
    weight_bytes: int        # everything one decode step reads (all linear weights, norms, LM head)
    layer_params: int        # matmul weights of the decoder layers (every token runs them)
    head_params: int         # the LM head (one row per sampled token)
    attn_flops_per_pair: int  # q·k and p·v flops for one (query, key) pair, all layers and heads

    def decode_flops(self, context: int = 0) -> float:
        """Flops of one decode token reading `context` cached keys."""
        return 2 * (self.layer_params + self.head_params) + self.attn_flops_per_pair * context

    def prefill_flops(self, tokens: int) -> float:
        """Flops of a cold `tokens`-token prompt (causal attention, one sampled row)."""
        attention = self.attn_flops_per_pair * tokens * (tokens + 1) / 2
        return 2 * self.layer_params * tokens + 2 * self.head_params + attention


def random_prompts(rng: random.Random, vocab: int, lengths: list[int]) -> list[list[int]]:
    """Token ids from the middle of the vocabulary (no special tokens), deterministic per seed."""
    return [[rng.randrange(100, vocab - 100) for _ in range(n)] for n in lengths]


def _best(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _sync(device: str) -> Callable[[], None]:
    import torch
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _bandwidth(device: str, sync: Callable[[], None]) -> tuple[float, float]:
    """Read and copy bytes/s over 512 MiB (2 GiB on a GPU); the buffers are freed on return."""
    import torch
    src = torch.ones((512 if device.startswith("cuda") else 128) * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = nbytes / _best(lambda: src.sum(), 5, sync)
    copy = 2 * nbytes / _best(lambda: dst.copy_(src), 5, sync)
    return read, copy


def measure_machine(device: str = "cpu") -> MachineSpeed:
    """Read and copy bandwidth over 512 MiB (2 GiB on a GPU) and the matmul peak."""
    import torch
    cuda = device.startswith("cuda")
    sync = _sync(device)
    read, copy = _bandwidth(device, sync)
    n = 4096 if cuda else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    b = torch.randn_like(a)
    flops = 2 * n**3 / _best(lambda: a @ b, 10, sync)
    return MachineSpeed(read / 1e9, copy / 1e9, flops / 1e9)


def _linear_cost(lin: Any) -> tuple[int, int]:
    """(parameters, bytes as held) of a `worker.model.linear.Linear`: its own format's bytes when it
    is packed in one (Q8_0 / Q4 / bf16, scales included), else its dense weight's."""
    params = lin.out_features * lin.weight.shape[1]
    if lin.qweight is not None:
        return params, lin.qweight.nbytes
    return params, params * lin.weight.element_size()


def model_cost(model: Any) -> ModelCost:
    """The cost figures of a `worker.model.llama.LlamaModel`; weight_bytes at the weights' real size."""
    cfg = model.cfg
    layers = [_linear_cost(lin) for layer in model.layers
              for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj.proj, layer.down_proj)]
    head_params, head_bytes = _linear_cost(model.lm_head)
    norms = sum(layer.ln1.numel() + layer.ln2.numel() for layer in model.layers) + model.norm.numel()
    weight_bytes = sum(b for _, b in layers) + head_bytes + norms * model.norm.element_size()
    return ModelCost(weight_bytes=weight_bytes, layer_params=sum(p for p, _ in layers), head_params=head_params,
                     attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)


def decode_roofline(machine: MachineSpeed, cost: ModelCost) -> float:
    """Batch-1 decode tokens/s: one read of the weights per token, or the matmul peak if slower."""
    return min(machine.read_gb_s * 1e9 / cost.weight_bytes, machine.matmul_gflop_s * 1e9 / cost.decode_flops())


def workload_roofline(machine: MachineSpeed, cost: ModelCost, prompt_lens: Sequence[int],
                      output_lens: Sequence[int]) -> float:
    """Output tokens/s of a batch (every request's prompt, then its output tokens, all admitted
    at once): every prompt's prefill at the matmul peak (the first output token comes from it),
    then step s reads the weights once and runs the rows still going, whichever is slower."""
    bw, peak = machine.read_gb_s * 1e9, machine.matmul_gflop_s * 1e9
    prefill = sum(cost.prefill_flops(n) for n in prompt_lens)
    seconds = max(cost.weight_bytes / bw, prefill / peak)
    for step in range(1, max(output_lens)):
        live = [p + step for p, n in zip(prompt_lens, output_lens) if n > step]
        flops = sum(cost.decode_flops(ctx) for ctx in live)
        seconds += max(cost.weight_bytes / bw, flops / peak)
    return sum(output_lens) / seconds


def measure_linear_gb_s(model: Any, rows: int, device: str = "cpu", repeats: int = 5) -> float:
    """Weight bytes / seconds of the linear layers of one decode step of `rows` rows, run alone
    as the model runs them (fused norms, the gated MLP, residual adds, the LM head)."""
    import torch
    cfg = model.cfg
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, cfg.hidden_size, generator=g, device=device, dtype=model.dtype)
    o = torch.randn(rows, cfg.num_heads * cfg.head_dim, generator=g, device=device, dtype=model.dtype)
    h = torch.randn(rows, cfg.intermediate_size, generator=g, device=device, dtype=model.dtype)
    eps = cfg.rms_norm_eps

    @torch.inference_mode()
    def step() -> None:
        for layer in model.layers:
            layer.qkv_proj.normed(x, layer.ln1, eps)
            layer.o_proj.add_to(x, o)
            layer.gate_up_proj.normed(x, layer.ln2, eps)
            layer.down_proj.add_to(x, h)
        model.lm_head.normed(x, model.norm, eps)

    cost = model_cost(model)
    return cost.weight_bytes / _best(step, repeats, _sync(device)) / 1e9


class DecodePhase(NamedTuple):
    """One batch run split as llama-batched-bench splits it: the prompts' prefill up to every
    request's first token, then the decode steps after it."""

    prefill_s: float
    decode_s: float
    decode_tokens: int   # tokens the decode steps produced (every request's after its first)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s


def decode_phase(engine: Any, prompts: list[list[int]], new_tokens: int) -> DecodePhase:
    """`prompts` admitted at once (cold), each run to 1 + `new_tokens` tokens: the time until every
    request has its first token (the prefill), then the time of the steps after that and the
    tokens they produced. With all prompts in one prefill step (they fit the step's token budget)
    this is llama-batched-bench's T_PP and T_TG for -npp len(prompt) -ntg new_tokens."""
    from worker.engine.request import prompt_input
    from worker.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    engine.store.reset_prefix_cache()
    ids = [engine.add_request(prompt_input(p, params)) for p in prompts]
    done: dict[str, int] = {}
    t0 = time.perf_counter()
    while len(done) < len(ids):
        for out in engine.step():
            if out.completion_tokens and out.request_id not in done:
                done[out.request_id] = out.completion_tokens
    t1 = time.perf_counter()
    first = sum(done.values())          # tokens out before the decode phase (1 each in one prefill)
    while engine.has_unfinished():
        engine.step()
    t2 = time.perf_counter()
    return DecodePhase(t1 - t0, t2 - t1, len(ids) * (new_tokens + 1) - first)


def best_decode_phase(engine: Any, prompts: list[list[int]], new_tokens: int, runs: int) -> DecodePhase:
    """`decode_phase` `runs` times; the fastest prefill and the fastest decode (a busy moment on a
    shared machine only slows a run down)."""
    phases = [decode_phase(engine, prompts, new_tokens) for _ in range(runs)]
    best = min(phases, key=lambda p: p.decode_s / p.decode_tokens)
    return best._replace(prefill_s=min(p.prefill_s for p in phases))


def bench_engine(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams
    from worker.kernels import native
    from worker.server.metrics import metrics_cost

    device = getattr(args, "device", "cpu")
    cuda = device.startswith("cuda")
    dtype_name, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
    threads = getattr(args, "threads", 0)
    engine = Engine(EngineConfig(model=args.model, dtype=dtype_name, device=device, threads=threads,
                                 weight_dtype=getattr(args, "weight_dtype", "auto"),
                                 attention_backend=getattr(args, "attention_backend", "auto"),
                                 enforce_eager=getattr(args, "enforce_eager", False)))
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=dtype).to(device).eval()
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    n1 = 32 if args.quick else 128
    batch_n = 16
    prompt_lens = [rng.randrange(16, 128 if args.quick else 256) for _ in range(batch_n)]
    out_lens = [rng.randrange(8, 32 if args.quick else 128) for _ in range(batch_n)]
    prompts = random_prompts(rng, vocab, [64] + prompt_lens)
    p1, pb = prompts[0], prompts[1:]

    def kv_run(ps: list[list[int]], lens: list[int]) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        engine.store.reset_prefix_cache()
        t = time.perf_counter()
        outs = engine.generate(ps, params)
        return time.perf_counter() - t, sum(o.completion_tokens for o in outs)

    def hf_run(hf: Any, ps: list[list[int]], lens: list[int]) -> tuple[float, int]:
        # HF generate pads the batch (left) and runs every row to the longest requested output;
        # only the tokens each request asked for count as useful.
        width = max(len(p) for p in ps)
        pad = engine.model_config.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                        do_sample=False, pad_token_id=pad)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, sum(lens)

    def prefill_s(n: int) -> float:
        # a cold prompt of n tokens run to its first token
        engine.store.reset_prefix_cache()
        prompt = random_prompts(rng, vocab, [n])[0]
        t = time.perf_counter()
        engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    kv_run([p1], [4])       # warm-up both
    hf_run(hf, [p1], [4])
    results: dict[str, Any] = {}
    # batch 1 is short and its steps are short: one busy moment on a shared machine moves it a lot,
    # so it is the best of 2 runs for each side; batch 16 is one run each
    for name, ps, lens, runs in (("batch1", [p1], [n1], 2), ("batch16", pb, out_lens, 1)):
        kt, kn = min(kv_run(ps, lens) for _ in range(runs))
        ht, hn = min(hf_run(hf, ps, lens) for _ in range(runs))
        results[name] = {"kvmesh_tok_s": kn / kt, "hf_tok_s": hn / ht, "speedup": (kn / kt) / (hn / ht),
                         "kvmesh_s": kt, "hf_s": ht, "tokens": kn}
    batch_params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in out_lens]
    results["metrics_cost"] = metrics_cost(engine, pb, batch_params, 3 if args.quick else 5)
    prefill_n = min(1024, engine.max_model_len - 2)
    prefill_best = min(prefill_s(prefill_n) for _ in range(2 if args.quick else 3))
    engine.store.reset_prefix_cache()
    del hf
    mc = engine.model_config
    cost = model_cost(engine.runner.model)
    machine = measure_machine(device)
    roof1 = decode_roofline(machine, cost)
    roof16 = workload_roofline(machine, cost, prompt_lens, out_lens)
    results["batch1"].update(roofline_tok_s=roof1, roofline_frac=results["batch1"]["kvmesh_tok_s"] / roof1,
                             linear_gb_s=measure_linear_gb_s(engine.runner.model, 1, device))
    results["batch16"].update(roofline_tok_s=roof16, roofline_frac=results["batch16"]["kvmesh_tok_s"] / roof16,
                              linear_gb_s=measure_linear_gb_s(engine.runner.model, batch_n, device))
    prefill64_best = min(prefill_s(64) for _ in range(3 if args.quick else 5))
    # llama-batched-bench's shape: 1 and 16 cold 64-token prompts, then n1 decode steps, the
    # decode timed apart from the prefill (its S_TG); batch*.kvmesh_tok_s above include the prefill
    phase_prompts = random_prompts(rng, vocab, [64] * batch_n)
    for name, b, runs in (("batch1", 1, 5), ("batch16", batch_n, 2)):
        ph = best_decode_phase(engine, phase_prompts[:b], n1, runs)
        results[name].update(decode_tok_s=ph.decode_tok_s, decode_prefill64_tok_s=64 * b / ph.prefill_s)
    results["batch1"]["decode_roofline_frac"] = results["batch1"]["decode_tok_s"] / roof1
    prefill_gflop_s = cost.prefill_flops(prefill_n) / prefill_best / 1e9
    results["prefill"] = {"tokens": prefill_n, "seconds": prefill_best, "tok_s": prefill_n / prefill_best,
                          "gflop_s": prefill_gflop_s, "peak_frac": prefill_gflop_s / machine.matmul_gflop_s,
                          "tok_s_64": 64 / prefill64_best}
    results["batch1"]["weight_bytes_per_token"] = cost.weight_bytes
    results["weight_dtype"] = engine.cfg.weight_dtype
    results["weight_format"] = engine.runner.weight_format
    results["roofline_tok_s"] = roof1
    results["roofline"] = {"read_gb_s": machine.read_gb_s, "copy_gb_s": machine.copy_gb_s,
                           "matmul_gflop_s": machine.matmul_gflop_s, "weight_bytes": cost.weight_bytes,
                           "batch1_tok_s": roof1, "batch16_tok_s": roof16}
    results["config"] = {"model": mc.name, "dtype": dtype_name, "device": str(engine.device), "batch1_new_tokens": n1,
                         "attention_backend": engine.runner.attention_backend.value,
                         "cuda_graphs": engine.runner.cuda_graphs is not None,
                         "native_decode_attention": native.load() is not None,
                         "native_linear": engine.runner.model.lm_head.packed is not None
                         or engine.runner.model.lm_head.qweight is not None,
                         "qlinear_isa": native.qlinear_isa(), "threads": torch.get_num_threads(),
                         "batch16_prompt_lens": prompt_lens, "batch16_output_lens": out_lens}
    if getattr(args, "llama_cpp", None) is not None and not cuda:
        from kvmesh.bench.llama_cpp import side_by_side

        mine = {"batch1_tok_s": results["batch1"]["decode_tok_s"], "batch16_tok_s": results["batch16"]["decode_tok_s"],
                "prefill64_tok_s": results["prefill"]["tok_s_64"]}
        results["llama_cpp"] = side_by_side(args.llama_cpp, args.model, engine.cfg.weight_dtype,
                                            torch.get_num_threads(), n1, mine)
    results["notes"] = ENGINE_NOTES
    return results


ENGINE_NOTES = {
    "roofline_frac": "kvmesh tokens/s over the roofline of the same workload (worker.bench_roofline): batch 1 "
                     "reads every weight once per token at roofline.read_gb_s; batch 16 runs its prompts at the "
                     "matmul peak, then each decode step at the slower of one weight read and its rows' flops",
    "batch1": "best of 2 runs for kvmesh and for HF (batch 16: one run each)",
    "decode_tok_s": "llama-batched-bench's shape: 1 (batch1) or 16 (batch16) cold 64-token random prompts admitted "
                    "at once, each run to 1 + <batch-1 new tokens> tokens; the steps after every request has its "
                    "first token are timed apart from the prefill before them (its T_TG vs T_PP): decode tokens / "
                    "decode seconds, best of 5 (batch 1) or 2 runs; decode_prefill64_tok_s: the prompt tokens / the "
                    "prefill of the same run (fastest). kvmesh_tok_s counts the prefill of its own workload too",
    "decode_roofline_frac": "batch1.decode_tok_s over the batch-1 read roofline (roofline.read_gb_s / the weight "
                            "bytes of one token): the decode alone against one weight read per token",
    "llama_cpp": "--llama-cpp: llama-batched-bench on the same GGUF (--weight-dtype auto: the checkpoint itself; "
                 "a named format: llama-quantize --allow-requantize --pure of it with the embedding and output in "
                 "that format too, the weights kvmesh runs) and thread count, -npp 64 -ntg <batch-1 new tokens> "
                 "-npl 1,16, run twice (the best of each figure, as kvmesh's side): S_TG of batch 1 and 16 "
                 "against kvmesh's batch1 / batch16 decode_tok_s (the same shape, "
                 "decode timed apart from the prefill), S_PP of batch 1 against prefill.tok_s_64",
    "linear_gb_s": "weight bytes / time of one decode step's linear layers (fused norms, gated MLP, residual "
                   "adds, LM head) run alone with 1 or 16 rows: the speed the weights are streamed at",
    "weight_bytes_per_token": "bytes of every weight one decode step reads, at their real size (Q8_0: 8.5 bits, "
                              "Q4_0 / Q4_1: 5 bits a weight, scales included; norms fp32); the read roofline "
                              "is roofline.read_gb_s over these bytes",
    "prefill": "a cold prompt of `tokens` random ids run to its first token, best of 2 (quick) or 3 (tok_s_64: "
               "a 64-token prompt, best of 3 or 5, as llama.cpp's S_PP at -npp 64); gflop_s "
               "counts the layers' matmuls, causal attention and one LM-head row; peak_frac = gflop_s / "
               "roofline.matmul_gflop_s",
    "metrics_cost": "the batch-16 workload with worker metrics (worker/server/metrics.py) fed as the server feeds them "
                    "(every output, every finished request, a snapshot every 0.5 s) vs without, interleaved, best "
                    "of 3 (quick) or 5 each; on_vs_off must be >= 0.97",
    "roofline": "read_gb_s: torch sum() of a 512 MiB fp32 tensor (every byte read once, beyond any cache), "
                "on the engine's threads; copy_gb_s: copy_() of 512 MiB, read + write bytes; "
                "matmul_gflop_s: a 1024^3 fp32 matmul (4096^3 bf16 on a GPU); best of 5-10 each",
}
