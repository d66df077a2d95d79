import difflib
import fp4cache._kernels as K
have = K.nvrtc_backends()
print("backends", have)
spec = K.varlen_attention_spec("bf16", 128, 1)
src = K.build_source(spec.file, [spec])
logs = {b: K.compile_log(src, spec.file, "sm_90", ("-Xptxas", "-v"), b).splitlines() for b in have}
if len(have) > 1:
    for ln in difflib.unified_diff(logs[have[0]], logs[have[1]], lineterm="", n=1):
        print(ln[:300])
