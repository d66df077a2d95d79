"""``python -m fp4cache``: store synthetic K/V in an NVFP4 cache, gather them back, report.

Prints bytes per token, compression against bf16, reconstruction error (relative RMSE
and SNR) for ``static6`` and ``4over6``, store / gather speed, and one decode step of
``decode_attention`` over the pages (time, and error against float64 attention), on the
GPU when one is usable (CuPy), else on the CPU (NumPy backend, the bit-exact reference:
slow on purpose).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ml_dtypes
import numpy as np

from . import PagedKVCache, __version__, calibrate_scale, gpu_available
from ._backend import backend
from ._device import host_memory

DESCRIPTION = (
    "Store synthetic K/V in an NVFP4 paged KV cache, gather them back and report bytes per "
    "token, compression, reconstruction error (static6 vs 4over6), store/gather speed and "
    "one decode_attention step over the pages (time, error against float64 attention): "
    "GB/s on the GPU (CuPy), tokens/s on the CPU (the NumPy reference backend)."
)

#: Query heads per KV head in the attention step (GQA group of Llama-3-8B: 32 on 8).
ATTN_GROUP = 4
#: Sequences in the attention step (at most; fewer when the pool has fewer pages).
ATTN_BATCH = 8
#: Host bytes the demo holds per K/V value at its peak, all arrays together (synthetic
#: float32 and bf16 K/V, the gathered pages, the float64 error and attention references;
#: a CPU run of 32768 tokens peaked at 25 bytes per value, 1.7 GB RSS).
HOST_BYTES_PER_VALUE = 40
#: Device bytes per K/V value on the GPU (bf16 K/V, the gathered bf16 and float32 pages,
#: the pool).
DEVICE_BYTES_PER_VALUE = 14


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def _non_negative(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {n}")
    return n


def _prog() -> str:
    """``fp4cache`` for the console script, ``python -m fp4cache`` otherwise."""
    name = sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] if sys.argv else ""
    return "fp4cache" if name in ("fp4cache", "fp4cache.exe") else "python -m fp4cache"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_prog(), description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--tokens", type=_positive, default=None,
                   help="tokens to store (default: 65536 on the GPU, 4096 on the CPU)")
    p.add_argument("--heads", type=_positive, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=_positive, default=128,
                   help="head_dim: a multiple of 16, of 64 unless --no-swizzle (default 128)")
    p.add_argument("--block-size", type=_positive, default=16,
                   help="tokens per page: a multiple of 4 unless --no-swizzle (default 16)")
    p.add_argument("--layout", choices=("HND", "NHD"), default="HND",
                   help="row order in a page: head-major HND (vLLM's NVFP4 default) or "
                        "token-major NHD (default HND)")
    p.add_argument("--rule", choices=("static6", "4over6", "both"), default="both",
                   help="block-scale rule: static6 (vLLM), 4over6 (tries 4 and 6, keeps the "
                        "smaller error), or both (default)")
    p.add_argument("--no-swizzle", action="store_true",
                   help="store V scales linearly instead of trtllm-gen's swizzled order")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: CuPy kernels (error if no GPU is usable); cpu: NumPy "
                        "backend; auto: the GPU if one is usable (default)")
    p.add_argument("--reps", type=_positive, default=None,
                   help="timed repetitions (default 20 on the GPU, 3 on the CPU)")
    p.add_argument("--seed", type=_non_negative, default=0,
                   help="seed of the synthetic K/V and slot permutation (default 0)")
    return p


def _parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    swz = not args.no_swizzle
    if args.head_dim % 16:
        p.error(f"argument --head-dim: must be a multiple of 16, got {args.head_dim}")
    if swz and args.head_dim % 64:
        p.error(f"argument --head-dim: must be a multiple of 64 with swizzled V scales, got "
                f"{args.head_dim} (or pass --no-swizzle)")
    if swz and args.block_size % 4:
        p.error(f"argument --block-size: must be a multiple of 4 with swizzled V scales, got "
                f"{args.block_size} (or pass --no-swizzle)")
    return args


def _synthetic_kv(rng, n, h, d):
    """Keys with per-channel outliers (as real keys have) and Gaussian values."""
    k = rng.standard_normal((n, h, d), dtype=np.float32)
    k *= 1.0 + 4.0 * (rng.random((1, h, d), dtype=np.float32) < 0.03)
    v = rng.standard_normal((n, h, d), dtype=np.float32)
    return k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)


def _err(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    ref = ref.astype(np.float64)
    got = got.astype(np.float64)
    noise = np.sum((got - ref) ** 2)
    power = np.sum(ref**2)
    return float(np.sqrt(noise / power)), float(10 * np.log10(power / noise))


def _attention_ref(q: np.ndarray, k_slots: np.ndarray, v_slots: np.ndarray,
                   tables: np.ndarray, block_size: int) -> np.ndarray:
    """float64 ``softmax(q K^T / sqrt(D)) V`` of each sequence over the slots of its pages
    (``k_slots``/``v_slots``: (num_slots, H, D), what each slot holds), GQA as the cache."""
    B, Hq, D = q.shape
    H = k_slots.shape[1]
    out = np.empty((B, Hq, D))
    for b in range(B):
        slots = (tables[b][:, None] * block_size + np.arange(block_size)).ravel()
        kb = k_slots[slots].astype(np.float64)  # (L, H, D)
        vb = v_slots[slots].astype(np.float64)
        qb = q[b].astype(np.float64).reshape(H, Hq // H, D)
        s = np.einsum("hgd,lhd->hgl", qb, kb) / np.sqrt(D)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("hgl,lhd->hgd", w, vb).reshape(Hq, D)
    return out


def _progress(msg: str) -> None:
    print(f"... {msg}", flush=True)


def _table(rows, gpu: bool) -> list[str]:
    unit = "GB/s" if gpu else "tok/s"
    head = ("rule", "K rRMSE", "K dB", "V rRMSE", "V dB", "store ms", f"store {unit}",
            "gather ms", f"gather {unit}")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rule, ke, ve, t, sbw, gbw, s_tps, g_tps in rows:
        speed = (f"{sbw / 1e9:.1f}", f"{gbw / 1e9:.1f}") if gpu else (f"{s_tps:.3g}",
                                                                      f"{g_tps:.3g}")
        cells = (rule, f"{ke[0]:.4f}", f"{ke[1]:.2f}", f"{ve[0]:.4f}", f"{ve[1]:.2f}",
                 f"{t['store'] * 1e3:.3f}", speed[0], f"{t['gather'] * 1e3:.3f}", speed[1])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _attention_table(rows, gpu: bool) -> list[str]:
    unit = "GB/s (pages)" if gpu else "tok/s"
    head = ("rule", "ms", unit, "rRMSE vs fp64, same pages", "rRMSE vs fp64, bf16 K/V")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for rule, t, bw, tps, e_pages, e_orig in rows:
        speed = f"{bw / 1e9:.1f}" if gpu else f"{tps:.3g}"
        cells = (rule, f"{t * 1e3:.3f}", speed, f"{e_pages:.2e}", f"{e_orig:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _check_size(p: argparse.ArgumentParser, args, device: str) -> None:
    """Refuse (usage error, exit 2) a workload that cannot fit, before generating it."""
    n = _tokens(args, device)
    values = 2 * n * args.heads * args.head_dim  # K and V
    what = f"{n} tokens x {args.heads} heads x head_dim {args.head_dim}"
    need = HOST_BYTES_PER_VALUE * values
    have = host_memory()
    if have is not None and need > have:
        p.error(f"argument --tokens: {what} need about {_gib(need)} of host memory (the "
                f"demo's K/V and references), {_gib(have)} available; pass at most about "
                f"{max(1, n * have // need)} tokens")
    if device == "cuda":
        import cupy as cp

        free = cp.cuda.runtime.memGetInfo()[0]
        need = DEVICE_BYTES_PER_VALUE * values
        if need > free:
            p.error(f"argument --tokens: {what} need about {_gib(need)} of GPU memory, "
                    f"{_gib(free)} free on the GPU; pass at most about "
                    f"{max(1, n * free // need)} tokens")


def _tokens(args, device: str) -> int:
    return args.tokens or (65536 if device == "cuda" else 4096)


def main(argv=None) -> int:
    try:
        rc = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe could only be reported
        return rc
    except BrokenPipeError:
        # The reader went away (``| head``): the standard exit of the Python docs (signal
        # module, "Note on SIGPIPE"): send what is still buffered to devnull, exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv=None) -> int:
    p = _parser()
    args = _parse(p, argv)
    if args.device == "cuda":
        try:
            backend("cuda")  # the library's own check and its one-line message
        except RuntimeError as e:
            print(f"{_prog()}: error: {e}", file=sys.stderr)
            return 1
    device = ("cuda" if gpu_available() else "cpu") if args.device == "auto" else args.device
    _check_size(p, args, device)
    try:
        return _run(args, device)
    except (RuntimeError, MemoryError) as e:  # a GPU that fails mid-run, an oversized pool
        print(f"{_prog()}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _run(args, device: str) -> int:
    gpu = device == "cuda"
    n = _tokens(args, device)
    reps = args.reps or (20 if gpu else 3)
    H, D, T = args.heads, args.head_dim, args.block_size
    swz = not args.no_swizzle
    _progress(f"generating {n} tokens of synthetic bf16 K/V (seed {args.seed})")
    rng = np.random.default_rng(args.seed)
    k_np, v_np = _synthetic_kv(rng, n, H, D)
    num_blocks = -(-n // T)
    slots_np = rng.permutation(num_blocks * T)[:n].astype(np.int64)
    blocks_np = np.arange(num_blocks, dtype=np.int32)
    # One decode step: B sequences of whole pages (their tokens in slot order), one bf16
    # query each, ATTN_GROUP query heads per KV head.
    B = min(ATTN_BATCH, num_blocks)
    tables_np = np.arange(B * (num_blocks // B), dtype=np.int32).reshape(B, -1)
    lens_np = np.full(B, tables_np.shape[1] * T, dtype=np.int32)
    q_np = rng.standard_normal((B, ATTN_GROUP * H, D), dtype=np.float32)
    q_np = q_np.astype(ml_dtypes.bfloat16)
    # What each slot holds before quantization (zeros where no token was stored).
    k_slots = np.zeros((num_blocks * T, H, D), np.float32)
    v_slots = np.zeros((num_blocks * T, H, D), np.float32)
    k_slots[slots_np], v_slots[slots_np] = k_np, v_np

    if gpu:
        import cupy as cp

        xp = cp
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
        where = f"GPU ({name}, CuPy {cp.__version__})"

        def sync():
            cp.cuda.get_current_stream().synchronize()
    else:
        xp = np
        where = ("CPU (NumPy reference backend; no usable GPU)" if args.device == "auto"
                 else "CPU (NumPy reference backend)")

        def sync():
            pass

    k, v = xp.asarray(k_np), xp.asarray(v_np)
    slots, blocks = xp.asarray(slots_np), xp.asarray(blocks_np)
    q, tables, lens = xp.asarray(q_np), xp.asarray(tables_np), xp.asarray(lens_np)
    print(f"fp4cache demo on {where}")
    print(f"workload: {n} tokens x {H} heads x head_dim {D}, bf16, block_size {T}, "
          f"layout {args.layout}, {num_blocks} pages")

    rules = ("static6", "4over6") if args.rule == "both" else (args.rule,)
    rows = []
    attn_rows = []
    counted = []
    for rule in rules:
        k_scale, v_scale = calibrate_scale(k, rule), calibrate_scale(v, rule)
        cache = PagedKVCache(num_blocks, T, H, D, layout=args.layout, scale_rule=rule,
                             k_scale=k_scale, v_scale=v_scale, swizzle_v_scales=swz,
                             device=device)
        if rule == rules[0]:
            print(f"bytes per token (K+V, all heads): {cache.bytes_per_token} NVFP4 vs "
                  f"{2 * H * D * 2} bf16 vs {2 * H * D} fp8 -> {cache.compression_ratio:.2f}x "
                  "smaller than bf16")
            print(f"pool: {cache.nbytes / 2**20:.1f} MiB for {num_blocks * T} token slots")
        _progress(f"{rule}: scales calibrated (k_scale {k_scale:.4g}, v_scale {v_scale:.4g}); "
                  "first store and gather" + (" (compiles the kernels)" if gpu else ""))
        cache.store(slots, k, v)
        k_out, v_out = cache.gather_dequant(blocks)
        a_out = cache.decode_attention(q, tables, lens)
        sync()
        times = {}

        def run_store(c=cache):
            c.store(slots, k, v)

        def run_gather(c=cache, o=(k_out, v_out)):
            c.gather_dequant(blocks, out=o)

        def run_attention(c=cache, o=a_out):
            c.decode_attention(q, tables, lens, out=o)

        for label, fn in (("store", run_store), ("gather", run_gather),
                          ("decode_attention", run_attention)):
            _progress(f"{rule}: timing {label}, {reps} repetition(s)")
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            times[label] = (time.perf_counter() - t0) / reps
        kg = k_out.get() if gpu else k_out
        vg = v_out.get() if gpu else v_out
        kg = kg.reshape(-1, H, D)[slots_np].astype(np.float32)
        vg = vg.reshape(-1, H, D)[slots_np].astype(np.float32)
        k_err = _err(k_np.astype(np.float32), kg)
        v_err = _err(v_np.astype(np.float32), vg)
        bf16_bytes = 2 * n * H * D * 2
        nvfp4_bytes = n * cache.bytes_per_token
        store_bw = (bf16_bytes + nvfp4_bytes + slots_np.nbytes) / times["store"]
        gather_bw = (num_blocks * cache.geometry.page_bytes + 2 * num_blocks * T * H * D * 2
                     + blocks_np.nbytes) / times["gather"]
        rows.append((rule, k_err, v_err, times, store_bw, gather_bw, n / times["store"],
                     num_blocks * T / times["gather"]))
        del kg, vg
        kf, vf = cache.gather_dequant(blocks, dtype="float32")  # what the kernel reads
        kf = (kf.get() if gpu else kf).reshape(-1, H, D)
        vf = (vf.get() if gpu else vf).reshape(-1, H, D)
        got = a_out.get() if gpu else a_out
        e_pages = _err(_attention_ref(q_np, kf, vf, tables_np, T), got)[0]
        del kf, vf
        e_orig = _err(_attention_ref(q_np, k_slots, v_slots, tables_np, T), got)[0]
        t_attn = times["decode_attention"]
        attn_tokens = int(lens_np.sum())
        attn_rows.append((rule, t_attn, attn_tokens * cache.bytes_per_token / t_attn,
                          attn_tokens / t_attn, e_pages, e_orig))
        st = cache.stats
        counted.append(f"{rule}: " + ", ".join(
            f"{what} {st['k_' + what + '_groups']}/{st['v_' + what + '_groups']}"
            for what in ("saturated", "underflow", "nonfinite")))

    print()
    for line in _table(rows, gpu):
        print(line)
    if gpu:
        print("\nGB/s count bytes read + written once (bf16 K/V, NVFP4 pages, index arrays).")
    else:
        print("\ntok/s: tokens stored / gathered per second on the CPU by the NumPy "
              "backend,\nthe bit-exact reference (not a serving path; GB/s mean nothing "
              "there).")
    print("rRMSE: relative RMSE; dB: SNR.  Scales from fp4cache.calibrate_scale(k or v).")
    print(f"\ndecode_attention, one decode step: {B} sequences x {int(lens_np[0])} tokens, "
          f"{ATTN_GROUP * H} bf16 query heads\non {H} KV heads (cache.decode_attention straight "
          "from the pages):")
    for line in _attention_table(attn_rows, gpu):
        print(line)
    print("rRMSE of the outputs against float64 attention over the same dequantized pages "
          "(the\nkernel's arithmetic and bf16 rounding) and over the unquantized bf16 K/V "
          "(adds the\nNVFP4 error)." + (
              "  GB/s: NVFP4 page bytes read." if gpu else ""))
    print("groups of 16 (K/V) whose block scale saturated at 448, underflowed (zero or "
          "subnormal),\nor that held NaN/Inf (cache.stats; all 0 with calibrated scales):")
    for line in counted:
        print(f"  {line}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
