// fp4cache: moving whole pages of the paged pool as raw bytes (issue 24).  No decoding: the
// same kernels serve every geometry, layout and scale rule.
//
//   copy:   page dst[i] <- page src[i], i < n, in one launch, every read before any write.
//   read:   row out[i] <- page blocks[i] (rows of page_bytes, contiguous): read_blocks, and
//           the device side of a transfer to host memory.
//   write:  page blocks[i] <- row data[i]: write_blocks, and the device side of a transfer
//           from host memory.
//
// Why copy needs no scratch and no grid-wide barrier: a copy moves byte o of page src[i]
// to byte o of page dst[i]; the offset inside the page never changes.  CTA c owns the
// columns [c*W, (c+1)*W) of EVERY page (W = col_units * VW bytes): no other CTA reads or
// writes those bytes, for any pair.  It loads column c of all n source pages into shared
// memory, waits for the loads (cp.async.wait_all, __syncthreads), and only then stores
// them into the n destination pages.  So every read of a byte happens before any write of
// that byte, whatever the overlap of src and dst as sets; nothing else orders the CTAs.
// The host picks W so that n * W bytes fit in shared memory (W = COPY_COLUMN_BYTES, one
// DRAM sector, when they do; narrower columns for larger n).
//
// Ids outside [0, num_blocks) (only met by unvalidated calls): counted in
// stats[BAD_BLOCK_IDS] once per bad entry; copy and write skip the pair / row (nothing is
// written outside the pool, a valid destination of a bad source keeps its bytes); read
// writes a page that decodes to NaN (data 0, every scale byte 0x7F), like the gather.
#include "fp4_common.cuh"

// One memory access of VW bytes (VW divides page_bytes and the rows' alignment).
template <int VW> struct PageVec;
template <> struct PageVec<16> { typedef U32x4 type; };
template <> struct PageVec<8> { typedef U32x2 type; };
template <> struct PageVec<4> { typedef u32 type; };
template <> struct PageVec<2> { typedef u16 type; };
template <> struct PageVec<1> { typedef u8 type; };

template <typename IdT>
FP4C_DEVICE i64 load_page_id(const void* ids, u32 i) {
  return (i64)((const IdT*)ids)[i];
}

FP4C_DEVICE bool page_in_pool(i64 id, const PageMoveParams& P) {
  return (u64)id < (u64)P.num_blocks;
}

FP4C_DEVICE void count_bad_ids(const PageMoveParams& P, u32 bad) {
  if (bad) atomicAdd((u64*)P.stats + FP4C_STAT_BAD_BLOCK_IDS, (u64)bad);
}

FP4C_DEVICE u8* page_ptr(const PageMoveParams& P, i64 id) {
  return (u8*)P.buffer + (u64)id * (u64)P.page_bytes;
}

// ---------------------------------------------------------------------------
// copy
// ---------------------------------------------------------------------------
// Load piece e = i * k + j (pair i, vector j of this CTA's columns) into shared memory:
// cp.async for 16-byte vectors (sm_80+, no registers), a plain load otherwise.
template <int VW>
FP4C_DEVICE void copy_load(const u8* src, typename PageVec<VW>::type* s_piece) {
  typedef typename PageVec<VW>::type V;
  if constexpr (VW == 16) {
    u32 dst;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
        : "=r"(dst) : "l"(s_piece));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    *s_piece = *(const V*)src;
  }
}

template <typename IdT, int VW>
FP4C_DEVICE void copy_impl(const void* __restrict__ src, const void* __restrict__ dst,
                           const PageMoveParams& P) {
  typedef typename PageVec<VW>::type V;
  extern __shared__ __align__(16) u8 s_raw[];
  V* s_cols = (V*)s_raw;  // [n][k]: column pieces of the n source pages
  const u64 page_vecs = (u64)P.page_bytes / VW;
  const u64 col0 = (u64)blockIdx.x * P.col_units;  // first vector this CTA owns
  const u32 k = (u32)min((u64)P.col_units, page_vecs - col0);
  const u32 pieces = P.n * k;
  // step 1, load: column pieces of every source page
  for (u32 e = threadIdx.x; e < pieces; e += blockDim.x) {
    const u32 i = e / k, j = e - i * k;
    const i64 s = load_page_id<IdT>(src, i), d = load_page_id<IdT>(dst, i);
    const bool s_ok = page_in_pool(s, P), d_ok = page_in_pool(d, P);
    if (blockIdx.x == 0 && j == 0) count_bad_ids(P, (s_ok ? 0u : 1u) + (d_ok ? 0u : 1u));
    if (s_ok && d_ok) copy_load<VW>(page_ptr(P, s) + (col0 + j) * VW, s_cols + e);
  }
  // step 2: every load of this CTA's columns has landed before any store to them
  if constexpr (VW == 16) asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  // step 3, store: the pieces into the destination pages
  for (u32 e = threadIdx.x; e < pieces; e += blockDim.x) {
    const u32 i = e / k, j = e - i * k;
    const i64 s = load_page_id<IdT>(src, i), d = load_page_id<IdT>(dst, i);
    if (page_in_pool(s, P) && page_in_pool(d, P)) {
      *(V*)(page_ptr(P, d) + (col0 + j) * VW) = s_cols[e];
    }
  }
}

#define FP4C_COPY_PARAMS \
  const void *__restrict__ src, const void *__restrict__ dst, const PageMoveParams params

// NAME, id type, vector bytes
#define FP4C_PAGE_COPY_KERNEL(NAME, ID, VW)                                                \
  extern "C" __global__ void __launch_bounds__(FP4C_PAGE_MOVE_THREADS) NAME(FP4C_COPY_PARAMS) { \
    copy_impl<ID, VW>(src, dst, params);                                                   \
  }

// ---------------------------------------------------------------------------
// read (pages -> rows) and write (rows -> pages)
// ---------------------------------------------------------------------------
// One CTA per page at a time (grid-stride over the pages), its threads over the page's
// vectors: no division per vector, every warp access contiguous on both sides.

// The bytes of a page that decodes to NaN: data 0, scale bytes 0x7F (byte o of the page).
FP4C_DEVICE u8 nan_page_byte(u64 o, const PageMoveParams& P) {
  return (o % (u64)P.side_bytes) >= (u64)P.data_bytes ? (u8)0x7F : (u8)0;
}

template <typename IdT, int VW>
FP4C_DEVICE void read_impl(const void* __restrict__ blocks, u8* __restrict__ out,
                           const PageMoveParams& P) {
  typedef typename PageVec<VW>::type V;
  const u32 page_vecs = (u32)((u64)P.page_bytes / VW);
  for (u32 i = blockIdx.x; i < P.n; i += gridDim.x) {
    const i64 b = load_page_id<IdT>(blocks, i);
    V* row = (V*)(out + (u64)i * (u64)P.page_bytes);
    if (page_in_pool(b, P)) {
      const V* page = (const V*)page_ptr(P, b);
#pragma unroll 4
      for (u32 j = threadIdx.x; j < page_vecs; j += blockDim.x) row[j] = page[j];
    } else {
      if (threadIdx.x == 0) count_bad_ids(P, 1u);
      u8* bytes = (u8*)row;
      for (u32 o = threadIdx.x; o < (u32)P.page_bytes; o += blockDim.x) {
        bytes[o] = nan_page_byte(o, P);
      }
    }
  }
}

template <typename IdT, int VW>
FP4C_DEVICE void write_impl(const void* __restrict__ blocks, const u8* __restrict__ data,
                            const PageMoveParams& P) {
  typedef typename PageVec<VW>::type V;
  const u32 page_vecs = (u32)((u64)P.page_bytes / VW);
  for (u32 i = blockIdx.x; i < P.n; i += gridDim.x) {
    const i64 b = load_page_id<IdT>(blocks, i);
    if (!page_in_pool(b, P)) {  // skipped: nothing outside the pool is written
      if (threadIdx.x == 0) count_bad_ids(P, 1u);
      continue;
    }
    const V* row = (const V*)(data + (u64)i * (u64)P.page_bytes);
    V* page = (V*)page_ptr(P, b);
#pragma unroll 4
    for (u32 j = threadIdx.x; j < page_vecs; j += blockDim.x) page[j] = row[j];
  }
}

#define FP4C_READ_PARAMS \
  const void *__restrict__ blocks, u8 *__restrict__ out, const PageMoveParams params
#define FP4C_WRITE_PARAMS \
  const void *__restrict__ blocks, const u8 *__restrict__ data, const PageMoveParams params

#define FP4C_PAGE_READ_KERNEL(NAME, ID, VW)                                                \
  extern "C" __global__ void __launch_bounds__(FP4C_PAGE_MOVE_THREADS) NAME(FP4C_READ_PARAMS) { \
    read_impl<ID, VW>(blocks, out, params);                                                \
  }

#define FP4C_PAGE_WRITE_KERNEL(NAME, ID, VW)                                               \
  extern "C" __global__ void __launch_bounds__(FP4C_PAGE_MOVE_THREADS)                     \
      NAME(FP4C_WRITE_PARAMS) {                                                            \
    write_impl<ID, VW>(blocks, data, params);                                              \
  }

#ifdef FP4C_INSTANTIATIONS
FP4C_INSTANTIATIONS
#endif
