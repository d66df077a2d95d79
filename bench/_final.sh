#!/bin/bash
# final device run (tests, sanitizer, attention benchmark); logs under $OUT
export PYTHONPATH=. PYTHONUNBUFFERED=1
date -u +"%F %T UTC" | tee $OUT/date.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a $OUT/date.txt
timeout 100 python3 -m pytest -q --no-header -p no:cacheprovider tests/test_gpu_attention.py > $OUT/tests_attention.log 2>&1; echo "attention tests rc=$?"; tail -2 $OUT/tests_attention.log
timeout 150 python3 -m pytest -q -x --no-header -p no:cacheprovider tests/test_gpu_backend.py tests/test_gpu_decode_paths.py > $OUT/tests_backend.log 2>&1; echo "backend tests rc=$?"; tail -2 $OUT/tests_backend.log
K='dequant or bad or nan or clamped or no_allocation or (small and (8-16-128-HND or 3-4-128 or 2-12-128 or 2-16-256-NHD or 2-32-64))'
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q --no-header -p no:cacheprovider tests/test_gpu_attention.py -k "$K" > $OUT/memcheck.log 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | tail -3
timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q --no-header -p no:cacheprovider tests/test_gpu_attention.py -k "bad or (small and (8-16-128-HND or 2-12-128 or 2-16-256-NHD))" > $OUT/racecheck.log 2>&1; echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" $OUT/racecheck.log | tail -4
timeout 280 python3 bench/attention_bench.py --out $OUT/attention.json > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -E "^\|" $OUT/bench.log
