#!/usr/bin/env bash
# Verification on a GPU machine, from the repository root, in one call:
#   bash bench/device_check.sh tests   # the whole test suite (GPU tests must run), every
#                                      # kernel compiled first in 16 processes
#   bash bench/device_check.sh sanitize  # notebooks' code on the GPU, the demo,
#                                      # compute-sanitizer memcheck/racecheck
#   bash bench/device_check.sh bench   # bench/bench.py (copy ceiling, kernels, PyTorch)
#   bash bench/device_check.sh varlen  # attention for any query length: its GPU tests (both
#                                      # prefill routes), compute-sanitizer memcheck and
#                                      # racecheck over the wgmma, few-row and 128-row
#                                      # mma.sync kernels' cases
#                                      # (~7 min)
#   bash bench/device_check.sh exact-new  # the exact new tokens: their GPU tests with the
#                                      # any-length, decode, window, plan, interop and hf
#                                      # tests, compute-sanitizer memcheck / racecheck over
#                                      # theirs, the prefill row with and without them
#   bash bench/device_check.sh varlen-bench  # the varlen_bench table beside SDPA (JSON in $OUT)
#   bash bench/device_check.sh vllm    # fp4cache.vllm: tests/test_vllm.py on the GPU, then
#                                      # bench/vllm_bench.py agree (greedy tokens against
#                                      # vLLM's bf16 backend); needs the vLLM kit carried as
#                                      # .vllm-kit (cp -r ../shared/vllm-kit .vllm-kit)
#   bash bench/device_check.sh vllm-bench  # bench/vllm_bench.py throughput (KV capacity,
#                                      # prefill, decode tok/s beside bf16; FORMATS, CELLS)
# Logs go to $OUT (default /tmp/fp4cache-device).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-/tmp/fp4cache-device}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import cupy; print('cupy', cupy.__version__, 'runtime', cupy.cuda.runtime.runtimeGetVersion())"

run_notebook_code() {  # the code cells of each notebook, in order, in one namespace
  MPLBACKEND=Agg timeout 120 python3 - "$@" <<'PY'
import importlib.util, json, sys, time, pathlib, os
for nb in sys.argv[1:]:
    t = time.time()
    ns = {"__name__": "__main__"}
    os.chdir(pathlib.Path(nb).resolve().parent)
    book = json.load(open(pathlib.Path(nb).name))
    cells = book["cells"]
    need = book.get("metadata", {}).get("fp4cache", {}).get("requires", [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:  # its own requirements (metadata.fp4cache.requires), as notebooks/execute.py
        print(f"NOTEBOOK SKIPPED {nb}: needs {', '.join(missing)}", flush=True)
        continue
    for c in cells:
        if c["cell_type"] == "code":
            exec(compile("".join(c["source"]), nb, "exec"), ns)
    print(f"NOTEBOOK OK {nb} {time.time() - t:.1f}s", flush=True)
PY
}

compile_every_kernel() {  # every specialization into CuPy's disk cache, 16 processes
  timeout 200 python3 - <<'PY'
import multiprocessing as mp
import time


def one(i):
    from fp4cache import _kernels as K
    K.get_kernel(K.all_specs()[i])


if __name__ == "__main__":
    from fp4cache import _kernels as K
    t = time.time()
    n = len(K.all_specs())
    with mp.get_context("fork").Pool(16) as pool:
        list(pool.imap_unordered(one, range(n)))
    print(f"compiled {n} kernel specializations in {time.time() - t:.0f} s", flush=True)
PY
}

install_vllm_kit() {  # vLLM 0.25 and its missing dependencies into /tmp/vsite, once
  [ -f .vllm-kit/vllm_slim.tar.xz ] || { echo "carry the vLLM kit as .vllm-kit"; exit 2; }
  if [ ! -f /tmp/vsite/.vllm25_ok ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite \
        .vllm-kit/whl/*.whl
    tar -xJf .vllm-kit/vllm_slim.tar.xz -C /tmp/vsite && touch /tmp/vsite/.vllm25_ok
  fi
  export PYTHONPATH=/tmp/vsite:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
      TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}

case "${1:-tests}" in
tests)
  compile_every_kernel
  timeout 500 python3 -m pytest -q -n 14 -rs -p no:cacheprovider -W ignore::FutureWarning \
      --durations=15 tests/ 2>&1 | tee "$OUT/tests.log" | tail -45
  ;;
sanitize)
  compile_every_kernel
  for nb in notebooks/*.ipynb; do
    (run_notebook_code "$PWD/$nb" 2>&1 | tail -40) >> "$OUT/notebooks.log"
  done
  grep -E "NOTEBOOK OK|NOTEBOOK SKIPPED|Error|error" "$OUT/notebooks.log" | head -20
  timeout 60 python3 -m fp4cache 2>&1 | tee "$OUT/demo.log"
  # (not reads_new_contents: under compute-sanitizer the frames of calls that launched a
  # kernel stay referenced, so that test's check that an entry goes with its arrays fails)
  for tool in memcheck racecheck; do
    timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider tests/test_errors.py tests/test_store.py \
        tests/test_gather.py tests/test_codec.py tests/test_longlive.py tests/test_devices.py \
        tests/test_plans.py ${SANITIZE_EXTRA:-} \
        -k "(cuda or stream or duplicate or graph or claim or pool or wide or decode or device or gpu or thread or prepared or signature) and not fuzz and not hypothesis and not reads_new_contents" \
        > "$OUT/sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' \
        "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"
  done
  ;;
bench)
  timeout 540 python3 bench/bench.py --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -70
  ;;
varlen)
  compile_every_kernel
  timeout 330 python3 -m pytest -q -n 16 -p no:cacheprovider -W ignore::FutureWarning \
      tests/test_attention_varlen.py tests/test_attention_decode.py tests/test_hf.py \
      tests/test_window.py tests/test_plans.py \
      2>&1 | tee "$OUT/varlen-tests.log" | tail -15
  # the wgmma kernel (route auto on sm_90): head_dim 128 / 64 / 256, GQA 1 / 4 / 16, a CTA
  # that takes every item, mixed batches, bad ids and NaN groups, unaligned page sides and
  # int64 block tables
  wg='TestKernel and auto and ((many_rows and (causal and (128-4 or 64-16 or 128-1) or 256)) or one_cta or mixed_batch or bad_ids or nan_groups or unaligned)'
  # and the few-row kernel's forms (one, two, four n8 tiles of rows)
  few='TestKernel and auto and (shared_q or speculative_split_kv or few_row_forms)'
  # and the mma.sync route's 128-row kernel (two sets of decoded tiles)
  mma='TestKernel and mma and (one_cta or nan_groups or unaligned or cuda_graph_with_chunks)'
  for tool in memcheck racecheck; do
    timeout 180 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider tests/test_attention_varlen.py \
        -k "($wg) or ($few) or ($mma)" \
        > "$OUT/varlen-sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' \
        "$OUT/varlen-sanitizer-$tool.log" | tr '\n' ' ')"
  done
  ;;
exact-new)
  # most telling first: the new tests, memcheck over them, then the neighbours' tests
  timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -W ignore::FutureWarning \
      tests/test_exact_new.py 2>&1 | tee "$OUT/exact-new-tests.log" | tail -8
  for tool in memcheck racecheck; do
    timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 -m pytest -q -p no:cacheprovider tests/test_exact_new.py -k "gpu and not hf" \
        > "$OUT/exact-new-sanitizer-$tool.log" 2>&1
    echo "compute-sanitizer $tool exit=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed|failed' \
        "$OUT/exact-new-sanitizer-$tool.log" | tr '\n' ' ')"
    [ "${QUICK:-}" ] && break
  done
  timeout 240 python3 -m pytest -q -n 16 -p no:cacheprovider -W ignore::FutureWarning \
      tests/test_attention_varlen.py tests/test_attention_decode.py tests/test_window.py \
      tests/test_plans.py tests/test_interop.py tests/test_hf.py \
      2>&1 | tee "$OUT/neighbour-tests.log" | tail -12
  timeout 100 python3 bench/varlen_bench.py --only prefill --window 3 --rotate --reps 5 \
      --out "$OUT/exact-new-bench.json" 2>&1 | tee "$OUT/exact-new-bench.log" | tail -12
  ;;
varlen-bench)
  timeout 540 python3 bench/varlen_bench.py --only spec prefill prefill_shapes mixed --reps 5 \
      --out "$OUT/varlen.json" 2>&1 \
      | tee "$OUT/varlen-bench.log" | tail -40
  ;;
vllm)
  install_vllm_kit
  timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm.py 2>&1 \
      | tee "$OUT/vllm-tests.log" | tail -8
  # shellcheck disable=SC2086
  timeout 440 python3 bench/vllm_bench.py agree --layers 4 --child-timeout 150 \
      --runs ${RUNS-prefix full-decode eager fp8} ${AGREE_ARGS-} --out "$OUT/vllm-agree.json" \
      2>&1 | tee "$OUT/vllm-agree.log" | tail -40
  ;;
vllm-bench)
  install_vllm_kit
  # one engine per format, a few minutes each: FORMATS="fp4cache" ... splits the table
  # over device calls
  # shellcheck disable=SC2086
  timeout 570 python3 bench/vllm_bench.py throughput \
      --cells ${CELLS:-32x8192 16x32768 256x8192 256x1024:128} \
      --formats ${FORMATS:-fp4cache bf16} --out "$OUT/vllm-throughput.json" 2>&1 \
      | tee "$OUT/vllm-throughput.log" | tail -30
  ;;
esac
