set -e
python3 -c "
from fp4cache import _kernels as K
s=[x for x in K.all_specs() if x.name=='fp4cache_decode_attn_f16_d128_g8']
open('/tmp/attn_src.cu','w').write(K.build_source('decode_attention.cu', s))"
nvcc -cubin -arch=sm_90 --fmad=false -ftz=true -std=c++17 -o /tmp/attn.cubin /tmp/attn_src.cu 2>&1 | grep -v warning | head -5
cuobjdump -sass /tmp/attn.cubin > $OUT/attn.sass
wc -l $OUT/attn.sass
