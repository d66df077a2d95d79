set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_gpu_decode_paths.py tests/test_gpu_backend.py 2>&1 | tail -3
timeout 200 python3 bench/kernel_timing.py --store-variants --store-only --reps 30 2>&1 | grep -E "store static6|copy"
