"""vLLM end to end with fp4cache's backend beside vLLM's own (GPU machine, vLLM 0.25).

Each configuration runs in its own process (one vLLM engine per process), on a
random-weight model built from a config (``load_format="dummy"``, token-id prompts, no
tokenizer):

- ``agree``: greedy decoding of the same prompts with fp4cache (nvfp4 pages) and vLLM's
  TRITON_ATTN over bf16 K/V (prompts sharing their first half); per step the top-2
  logprobs.  A step's token is compared
  where bf16's margin (top-1 minus top-2 logprob) is at least ``--margin`` nats, up to
  the first step where the two runs differ (after that the contexts differ); reports the
  agreement there and the logprob differences of the chosen tokens.  Also fp4cache with
  prefix caching on and off, eager against CUDA graphs (piecewise, and full graphs for
  decode steps, ``--full-decode-graphs``: the backend's builder then declares them): the
  same tokens.
- ``throughput``: KV capacity at ``gpu_memory_utilization`` (vLLM's blocks x block size),
  prefill time (``max_tokens=1``), decode tokens/s (the rest of a generation of new
  tokens) and total tokens/s for each ``BxL[:new]`` cell of random prompts; one engine
  per KV format runs every cell.

Run on the GPU machine from the repository root, with the vLLM kit installed
(``bash bench/device_check.sh vllm``), e.g.::

    PYTHONPATH=/tmp/vsite:. python3 bench/vllm_bench.py agree --out $OUT/agree.json
    PYTHONPATH=/tmp/vsite:. python3 bench/vllm_bench.py throughput \\
        --cells 32x8192 16x32768 256x8192 256x1024:128 --out $OUT/throughput.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
       "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1",
       # the engine in this process, for every format alike: the backend registered here
       # is the one it resolves (an installed wheel's entry point would register it in
       # every process vLLM starts)
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: KV formats: (vLLM attention backend, kv_cache_dtype)
FORMATS = {"fp4cache": ("CUSTOM", "nvfp4"), "bf16": ("TRITON_ATTN", "auto"),
           "fp8": ("TRITON_ATTN", "fp8")}
#: Llama-3-8B's geometry (random weights)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "max_position_embeddings": 65536, "hidden_act": "silu",
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def random_weights(model) -> None:
    """Weights a random model computes with: vLLM's dummy weights (uniform in +-1e-3)
    make every logit about 0, so no step has a margin to compare.  Seeded per parameter:
    norms 1, embeddings N(0, 1), projections N(0, 1 / fan_in), the LM head 4x that
    (sharper next-token distributions)."""
    import torch

    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            g = torch.Generator(device=p.device).manual_seed(i)
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() < 2:
                p.zero_()
            else:
                std = 1.0 if "embed" in name else \
                    p.shape[1] ** -0.5 * (4 if "lm_head" in name else 1)
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * std)


def model_dir(layers: int) -> str:
    """A folder holding only the config of a Llama-3-8B-shaped model (weights: dummy)."""
    d = Path(f"/tmp/fp4cache_vllm_llama3_8b_{layers}l")
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_hidden_layers": layers}))
    return str(d)


def prompts(n: int, length: int, seed: int, vocab: int = 128256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def shared_prefix_prompts(args):
    """``--batch`` prompts of ``--length`` tokens whose first half is one shared prefix
    (what prefix caching reuses)."""
    half = args.length // 2
    head = prompts(1, half, 0)[0]
    return [head + p for p in prompts(args.batch, args.length - half, 1)]


# -- one engine (a child process) --------------------------------------------------------------
def engine(args) -> dict:
    """Run one configuration; returns its results (printed as one JSON line)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if args.format == "fp4cache":
        import fp4cache.vllm

        fp4cache.vllm.register()  # the entry point does it too, where the wheel is installed
        if args.full_decode_graphs:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

            register_backend(AttentionBackendEnum.CUSTOM, "vllm_full_decode.FullDecodeBackend")
    backend, kv = FORMATS[args.format]
    t = time.perf_counter()
    llm = LLM(model=model_dir(args.layers), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", kv_cache_dtype=kv, attention_config={"backend": backend},
              gpu_memory_utilization=args.mem, max_model_len=args.max_model_len,
              enforce_eager=args.eager, enable_prefix_caching=args.prefix_caching, seed=0)
    if args.mode == "agree":
        llm.apply_model(random_weights)
    cfg = llm.llm_engine.vllm_config.cache_config
    out = {"format": args.format, "backend": backend, "kv_cache_dtype": kv,
           "eager": args.eager, "prefix_caching": args.prefix_caching,
           "full_decode_graphs": args.full_decode_graphs,
           "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
           "start_s": time.perf_counter() - t,
           "kv_capacity_tokens": int(cfg.num_gpu_blocks) * int(cfg.block_size)}
    if args.mode == "agree":
        sp = SamplingParams(max_tokens=args.new, temperature=0.0, logprobs=2,
                            ignore_eos=True, detokenize=False)
        ps = [TokensPrompt(prompt_token_ids=p) for p in shared_prefix_prompts(args)]
        if args.prefix_caching:  # the shared prefix's pages computed first, then reused
            llm.generate(ps[:1], SamplingParams(max_tokens=1, detokenize=False),
                         use_tqdm=False)
        res = llm.generate(ps, sp, use_tqdm=False)
        out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
        out["logprobs"] = [[sorted((lp.logprob for lp in step.values()), reverse=True)
                            for step in r.outputs[0].logprobs] for r in res]
        out["chosen_logprob"] = [[step[tok].logprob for tok, step in
                                  zip(r.outputs[0].token_ids, r.outputs[0].logprobs,
                                      strict=True)] for r in res]
    else:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(2, 1024, 2)],
                     SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False),
                     use_tqdm=False)  # warm-up
        out["cells"] = [measure(llm, cell) for cell in args.cells]
    return out


def parse_cell(cell: str) -> tuple[int, int, int]:
    """``BxL`` or ``BxL:new`` (new tokens; 256 when not given) -> (B, L, new)."""
    shape, _, new = cell.partition(":")
    b, length = (int(x) for x in shape.split("x"))
    return b, length, int(new or 256)


def measure(llm, cell: str) -> dict:
    """One cell on a running engine: prefill time (``max_tokens=1``), then the whole
    generation of other prompts of the same shape; decode is the difference."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    b, length, new = parse_cell(cell)
    row = {"cell": cell, "batch": b, "prompt_len": length, "new_tokens": new}
    for label, n_new, seed in (("prefill", 1, 3), ("full", new + 1, 4)):
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(b, length, seed)]
        sp = SamplingParams(max_tokens=n_new, ignore_eos=True, temperature=0.0,
                            detokenize=False)
        t = time.perf_counter()
        res = llm.generate(ps, sp, use_tqdm=False)
        row[f"{label}_s"] = time.perf_counter() - t
        assert all(len(r.outputs[0].token_ids) == n_new for r in res)
    row["decode_s"] = row["full_s"] - row["prefill_s"]
    row["decode_tok_s"] = b * new / row["decode_s"]
    row["prefill_tok_s"] = b * length / row["prefill_s"]
    row["total_tok_s"] = b * (length + new) / row["full_s"]
    print(json.dumps(row), flush=True)
    return row


def child(mode: str, fmt: str, a, **over) -> dict:
    """One configuration in a fresh process (a vLLM engine per process)."""
    cmd = [sys.executable, __file__, "--child", mode, "--format", fmt,
           "--layers", str(a.layers), "--batch", str(a.batch), "--length", str(a.length),
           "--new", str(a.new), "--mem", str(a.mem), "--max-model-len", str(a.max_model_len)]
    if over.get("eager", a.eager):
        cmd.append("--eager")
    if over.get("prefix_caching", False):
        cmd.append("--prefix-caching")
    if over.get("full_decode_graphs", False):
        cmd.append("--full-decode-graphs")
    if mode == "throughput":
        cmd += ["--cells", *a.cells]
    print("$", " ".join(cmd[1:]), flush=True)
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True,
                           timeout=a.child_timeout)
    except subprocess.TimeoutExpired as e:
        sys.stderr.write(str(e.stdout or "")[-4000:] + str(e.stderr or "")[-4000:])
        return {"format": fmt, "error": f"timed out after {a.child_timeout} s", **over}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode or not lines:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
        return {"format": fmt, "error": f"exit {r.returncode}", **over}
    print(f"  done in {time.perf_counter() - t:.0f} s", flush=True)
    return json.loads(lines[-1][len("RESULT "):])


# -- the comparisons ---------------------------------------------------------------------------
def agreement(ref: dict, got: dict, margin: float) -> dict:
    """Tokens of ``got`` against ``ref`` up to each sequence's first difference."""
    clear = same = steps = 0
    diffs = []
    for t_ref, t_got, lp_ref, c_ref, c_got in zip(ref["tokens"], got["tokens"],
                                                  ref["logprobs"], ref["chosen_logprob"],
                                                  got["chosen_logprob"], strict=True):
        for i, (a, b) in enumerate(zip(t_ref, t_got, strict=True)):
            steps += 1
            top = lp_ref[i]
            if len(top) > 1 and top[0] - top[1] >= margin:
                clear += 1
                same += a == b
            if a != b:
                break
            diffs.append(abs(c_ref[i] - c_got[i]))
    return {"steps_compared": steps, "clear_margin_steps": clear,
            "clear_margin_agreement": same / clear if clear else None,
            "logprob_diff_max": max(diffs) if diffs else None,
            "logprob_diff_mean": sum(diffs) / len(diffs) if diffs else None}


#: agree's runs beside the reference and fp4cache with CUDA graphs: (format, options)
AGREE_RUNS = {
    "prefix": ("fp4cache, prefix caching", "fp4cache", {"prefix_caching": True}),
    "full-decode": ("fp4cache full decode graphs", "fp4cache", {"full_decode_graphs": True}),
    "eager": ("fp4cache eager", "fp4cache", {"eager": True}),
    "fp8": ("fp8 graphs", "fp8", {})}


def run_agree(a) -> dict:
    ref = child("agree", "bf16", a)
    if "error" in ref:
        return {"reference": "bf16 TRITON_ATTN", "error": ref["error"]}
    out = {"reference": "bf16 TRITON_ATTN", "margin_nats": a.margin, "runs": {}}
    first = None
    # everything eager with --eager (no compilation: quicker engines)
    base = "fp4cache eager" if a.eager else "fp4cache graphs"
    runs = [(base, "fp4cache", {})] + [v for k, v in AGREE_RUNS.items()
                                                      if k in a.runs]
    for name, fmt, over in runs:
        r = child("agree", fmt, a, **over)
        row = out["runs"][name] = {"cudagraph_mode": r.get("cudagraph_mode")}
        if "error" in r:
            row["error"] = r["error"]
        else:
            row.update(agreement(ref, r, a.margin))
            if fmt == "fp4cache":
                first = first or r  # the graphs run: the others' tokens against it
                row[f"same_tokens_as_{base.replace(' ', '_')}"] = first["tokens"] == r["tokens"]
        print(name, json.dumps(row), flush=True)
    return out


def run_throughput(a) -> dict:
    rows = []
    for fmt in a.formats:  # one engine per format runs every cell
        r = child("throughput", fmt, a)
        for cell in r.pop("cells", [{"error": r.get("error")}]):
            rows.append({**r, **cell})
    return {"rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", choices=["agree", "throughput"], default="agree")
    ap.add_argument("--child", choices=["agree", "throughput"], help=argparse.SUPPRESS)
    ap.add_argument("--format", choices=sorted(FORMATS), help=argparse.SUPPRESS)
    ap.add_argument("--formats", nargs="+", default=["fp4cache", "bf16", "fp8"],
                    choices=sorted(FORMATS))
    ap.add_argument("--runs", nargs="*", default=list(AGREE_RUNS), choices=list(AGREE_RUNS),
                    help="agree: the runs besides bf16 and fp4cache with CUDA graphs")
    ap.add_argument("--cells", nargs="+", default=["32x8192"],
                    help="B x prompt length[:new tokens, 256 when not given]")
    ap.add_argument("--child-timeout", type=float, default=540,
                    help="seconds one engine may run")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--margin", type=float, default=0.5)
    ap.add_argument("--mem", type=float, default=0.9, help="gpu_memory_utilization")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--full-decode-graphs", action="store_true",
                    help="fp4cache's builder declares full CUDA graphs for decode steps")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.child:
        a.mode = a.child
        print("RESULT " + json.dumps(engine(a)), flush=True)
        return
    res = run_agree(a) if a.mode == "agree" else run_throughput(a)
    res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    res["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
