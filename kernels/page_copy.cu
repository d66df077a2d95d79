// fp4cache: moving whole pages of the paged pool as raw bytes.  No decoding: the
// same kernels serve every geometry, layout and scale rule.
//
//   mark + copy:  page dst[i] <- page src[i], i < n, in two launches, every read of a page
//                 before any write of it (copy_blocks).
//   read:   row out[i] <- page blocks[i] (rows of page_bytes, contiguous): read_blocks, and
//           the device side of a transfer to host memory.
//   write:  page blocks[i] <- row data[i]: write_blocks, and the device side of a transfer
//           from host memory.
//
// copy_blocks.  Two uint32 tables of num_blocks entries each (FP4C_COPY_TABLES, the
// cache's workspace tickets: zero before and after every call), indexed by page P:
//   pending[P]  participants of P not yet done with it: every pair that reads P (src[i] ==
//               P) and every pair that names P as its destination (dst[i] == P),
//   dst_of[P]   i + 1 for the pair i that writes P (the largest i with dst[i] == P), else 0,
// and n staging rows of page_bytes (workspace scratch, row i for pair i).
// A pair "moves" when both ids are in [0, num_blocks) and src[i] != dst[i]; other pairs are
// skipped by both launches (a self-copy leaves its page as it is, which is its copy).
//
//   launch 1, mark (a thread per pair): pending[src[i]] += 1, pending[dst[i]] += 1,
//             dst_of[dst[i]] = max(., i + 1); every id outside the pool counted once in
//             stats[BAD_BLOCK_IDS].
//   launch 2, copy (a CTA per pair): pair i with s = src[i], d = dst[i]
//     1. route (thread 0, three table loads at once):  not the writer of d (dst_of[d] !=
//        i + 1: a later pair repeats d, only unvalidated device ids can) -> NONE, write
//        nothing;
//        pending[d] == 1 (nobody reads d, or every other participant of d is done) ->
//        DIRECT, and d's entries go back to 0 (nobody else touches them any more);  else
//        STAGE.
//     2. stream: page s -> page d (DIRECT) or -> staging row i (STAGE), 16-byte vectors,
//        FP4C_COPY_UNROLL loads in flight per thread.  Every read of the pool and of the
//        staging rows goes to L2 (ld.global.cg), the point of coherence of the CTAs.
//     3. arrive (thread 0, after a __syncthreads; the threads of a STAGE pair fence their
//        stores first): atomicSub(pending[s], 1), and, unless it went DIRECT,
//        atomicSub(pending[d], 1).  The arrival that takes pending[P] to 0 finishes P.
//     4. finish P: if dst_of[P] != 0 the CTA (after a fence) copies staging row
//        dst_of[P] - 1 -> page P, and dst_of[P] = 0.
//
// Why no write to a page precedes a read of it: page P is read only by the pairs counted in
// pending[P] as its readers (counted by launch 1, complete before launch 2 starts), and
// each of them arrives at P only after its loads of P have returned: their values were
// stored (to d or to the staging row) before the __syncthreads that precedes the atomic.
// P is written either by its writer directly, when it reads pending[P] == 1, i.e. every
// other participant has arrived, or by the finisher of P, the last participant to arrive.
// Either one observed every reader's arrival (the value read, or the atomic's result) and
// fenced before its CTA's stores.  The staging row a finisher reads was written and fenced
// by every thread of its writer's CTA before that CTA's arrival, which the finisher's
// atomic saw.  Nobody waits on another CTA: no co-residency assumption, no deadlock, any
// grid size.
//
// Why both tables are 0 again after launch 2 (so graph replays start from zeros): every
// participant that launch 1 counted in pending[P] either arrives at P (one decrement) or is
// P's writer going DIRECT, which sees pending[P] == 1 (itself) and sets it to 0.  So
// pending[P] ends at 0.  dst_of[P] != 0 only for a written page, and P's writer either
// goes DIRECT (and zeroes it) or stages and arrives, and then P's last arrival zeroes it.
// dst_of[P] matters only to P's writer (read before its own arrival, so before any reset)
// and to P's last participant (nobody resets it before that one does); losers of a
// repeated d only compare it with their own i + 1, which it never equals.
//
// Fan-out (src repeats): pending[P] counts every reader, P is written after all of them.
// Cycles and swaps: the first pair of a cycle to run finds its destination still to be
// read and stages; the last arrival writes it back.  Disjoint src and dst: every pair goes
// DIRECT (2 * page_bytes of DRAM traffic per pair, as a device copy); a staged pair costs
// 4 * page_bytes.  Repeated dst (unvalidated device ids only): the pair with the largest i
// writes the page whole, the others write nothing; the tables still end at 0.
//
// Ids outside [0, num_blocks) (only met by unvalidated calls): counted in
// stats[BAD_BLOCK_IDS] once per bad entry (mark; read and write: once per row); copy and
// write skip the pair / row (nothing is written outside the pool, a valid destination of a
// bad source keeps its bytes); read writes a page that decodes to NaN (data 0, every scale
// byte 0x7F), like the gather.
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
// copy: helpers
// ---------------------------------------------------------------------------
// The tables (workspace tickets): pending, dst_of, num_blocks entries each.
static_assert(FP4C_COPY_TABLES == 2, "copy_blocks tables: pending, dst_of");
struct CopyTables {
  u32* pending;
  u32* dst_of;
};

FP4C_DEVICE CopyTables copy_tables(const PageMoveParams& P) {
  u32* t = (u32*)P.tables;
  return CopyTables{t, t + (u64)P.num_blocks};
}

// A table entry other CTAs change during the launch: read from L2, never from L1.
FP4C_DEVICE u32 ld_table(const u32* p) { return *(const volatile u32*)p; }

// Pair i: its ids, and whether it moves bytes (both ids in the pool, src != dst).  The same
// answer in both launches.
template <typename IdT>
FP4C_DEVICE bool copy_pair(const void* src, const void* dst, u32 i, const PageMoveParams& P,
                           i64& s, i64& d) {
  s = load_page_id<IdT>(src, i);
  d = load_page_id<IdT>(dst, i);
  return page_in_pool(s, P) && page_in_pool(d, P) && s != d;
}

// One VW-byte load from L2 (ld.global.cg, the __ldcg builtin): pool pages and staging rows
// that other CTAs of the launch write.
template <int VW>
FP4C_DEVICE typename PageVec<VW>::type ld_cg(const void* p) {
  typename PageVec<VW>::type r;
  if constexpr (VW == 16) {
    const uint4 v = __ldcg((const uint4*)p);
    r.x = v.x;
    r.y = v.y;
    r.z = v.z;
    r.w = v.w;
  } else if constexpr (VW == 8) {
    const uint2 v = __ldcg((const uint2*)p);
    r.x = v.x;
    r.y = v.y;
  } else if constexpr (VW == 4) {
    r = __ldcg((const unsigned int*)p);
  } else if constexpr (VW == 2) {
    r = __ldcg((const unsigned short*)p);
  } else {
    r = __ldcg((const unsigned char*)p);
  }
  return r;
}

// A page is streamed in rounds: each thread loads FP4C_COPY_UNROLL vectors (all in flight
// at once), then stores them; every warp access contiguous on both sides.  A round starts
// at vector j0 (threadIdx.x + k * FP4C_COPY_UNROLL * blockDim.x); one round covers a page
// of up to 32 KB (16-byte vectors, 512 threads).  Plain loads (no asm): the compiler
// orders them with the fences and barriers around them.
template <int VW>
struct Round {
  typename PageVec<VW>::type r[FP4C_COPY_UNROLL];

  FP4C_DEVICE void load(const u8* from, u32 j0, u32 vecs) {
    const u8* p = from + (u64)j0 * VW;
#pragma unroll
    for (u32 u = 0; u < FP4C_COPY_UNROLL; ++u, p += blockDim.x * VW) {
      if (j0 + u * blockDim.x < vecs) r[u] = ld_cg<VW>(p);
    }
  }
  FP4C_DEVICE void store(u8* to, u32 j0, u32 vecs) const {
    u8* p = to + (u64)j0 * VW;
#pragma unroll
    for (u32 u = 0; u < FP4C_COPY_UNROLL; ++u, p += blockDim.x * VW) {
      if (j0 + u * blockDim.x < vecs) *(typename PageVec<VW>::type*)p = r[u];
    }
  }
};

FP4C_DEVICE u32 vecs_per_page(const PageMoveParams& P, int vw) {
  return (u32)((u64)P.page_bytes / (u64)vw);
}

// The CTA copies page_bytes from `from` to `to`, a round at a time from the round that
// starts at vector j_start of this thread (not unrolled: the copy kernel fits 4 CTAs of
// 512 threads per SM, FP4C_COPY_MIN_CTAS).
template <int VW>
FP4C_DEVICE void stream_page(const u8* from, u8* to, const PageMoveParams& P, u32 j_start) {
  const u32 vecs = vecs_per_page(P, VW);
#pragma unroll 1
  for (u32 j0 = j_start; j0 < vecs; j0 += FP4C_COPY_UNROLL * blockDim.x) {
    Round<VW> r;
    r.load(from, j0, vecs);
    r.store(to, j0, vecs);
  }
}

// ---------------------------------------------------------------------------
// copy, launch 1: mark
// ---------------------------------------------------------------------------
template <typename IdT>
FP4C_DEVICE void mark_impl(const void* __restrict__ src, const void* __restrict__ dst,
                           const PageMoveParams& P) {
  const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= P.n) return;
  i64 s, d;
  const bool moves = copy_pair<IdT>(src, dst, i, P, s, d);
  count_bad_ids(P, (page_in_pool(s, P) ? 0u : 1u) + (page_in_pool(d, P) ? 0u : 1u));
  if (!moves) return;
  const CopyTables T = copy_tables(P);
  atomicAdd(T.pending + s, 1u);     // a reader of s
  atomicAdd(T.pending + d, 1u);     // a writer of d (losers of a repeated d too)
  atomicMax(T.dst_of + d, i + 1u);  // repeated d (unchecked ids): the last pair writes it
}

// ---------------------------------------------------------------------------
// copy, launch 2: load, route, stream, arrive, finish
// ---------------------------------------------------------------------------
enum CopyRoute : u32 { ROUTE_NONE = 0, ROUTE_DIRECT = 1, ROUTE_STAGE = 2 };

// What thread 0 reads of the tables for pair i, all at once (three loads in flight):
// dst_of[d], pending[d] and dst_of[s].  dst_of[d] and pending[d] decide the route.  As the
// staging row to copy, dst_of[s] / dst_of[d] are used only when this pair turns out to be
// the last participant of that page, and then nobody has changed them since launch 1
// (only the last participant, or a DIRECT writer that sees that everybody else has
// arrived and therefore never arrives itself, resets them).
struct PairTables {
  u32 writer_d, pending_d, writer_s;
};

FP4C_DEVICE PairTables read_tables(const CopyTables& T, i64 s, i64 d) {
  return PairTables{ld_table(T.dst_of + d), ld_table(T.pending + d), ld_table(T.dst_of + s)};
}

// Step 1 (thread 0): where pair i streams page s.  DIRECT when every other participant of
// d is done with it (or there is none): d's entries go back to 0 at once.
FP4C_DEVICE u32 route_pair(const CopyTables& T, const PairTables& t, u32 i, i64 d) {
  if (t.writer_d != i + 1u) return ROUTE_NONE;  // another pair writes d
  if (t.pending_d != 1u) return ROUTE_STAGE;    // d still has readers to come
  __threadfence();  // the readers' arrivals before this CTA's stores to d
  T.pending[d] = 0u;
  T.dst_of[d] = 0u;
  return ROUTE_DIRECT;
}

// Step 3 (thread 0): one arrival at page p (its writer: dst_of[p] as read in step 1).  The
// last one (pending[p] 1 -> 0) zeroes dst_of[p] and returns it (the staging row + 1 to
// copy into p; 0: p keeps its bytes); every other arrival returns 0.
FP4C_DEVICE u32 arrive(const CopyTables& T, i64 p, u32 writer) {
  if (atomicSub(T.pending + p, 1u) != 1u) return 0u;
  if (writer) T.dst_of[p] = 0u;
  return writer;
}

template <typename IdT, int VW>
FP4C_DEVICE void copy_impl(const void* __restrict__ src, const void* __restrict__ dst,
                           const PageMoveParams& P) {
  __shared__ u32 s_route;
  __shared__ i64 s_fin_page[2];  // pages this CTA finishes (-1: none)
  __shared__ u32 s_fin_row[2];   // the staging row copied into each
  __shared__ u32 s_writer[2];    // dst_of[s], dst_of[d] as read in step 1
  const u32 i = blockIdx.x;      // one CTA per pair
  i64 s, d;
  if (i >= P.n || !copy_pair<IdT>(src, dst, i, P, s, d)) return;  // the same for all threads
  const CopyTables T = copy_tables(P);
  u8* staging = (u8*)P.staging;
  // step 1, load the first round of page s while thread 0 reads the tables: safe before
  // this CTA's arrival at s, since no pair writes s until every reader has arrived (a
  // DIRECT writer sees pending[s] > 1, the finisher needs pending[s] to reach 0)
  const u32 vecs = vecs_per_page(P, VW);
  const u32 round = FP4C_COPY_UNROLL * blockDim.x;
  Round<VW> first;
  first.load(page_ptr(P, s), threadIdx.x, vecs);
  // step 2, route
  if (threadIdx.x == 0) {
    const PairTables t = read_tables(T, s, d);
    s_route = route_pair(T, t, i, d);
    s_writer[0] = t.writer_s;  // kept for step 3 (shared: no registers while streaming)
    s_writer[1] = t.writer_d;
  }
  __syncthreads();
  const u32 route = s_route;
  // step 3, stream page s: the first round from registers, the rest from memory
  u8* to = route == ROUTE_DIRECT ? page_ptr(P, d)
           : route == ROUTE_STAGE ? staging + (u64)i * (u64)P.page_bytes : nullptr;
  if (to != nullptr) {
    first.store(to, threadIdx.x, vecs);
    stream_page<VW>(page_ptr(P, s), to, P, threadIdx.x + round);
  }
  if (route == ROUTE_STAGE) __threadfence();  // the staging row visible before the arrival
                                              // that publishes it
  // step 4, arrive: every load of s by this CTA has returned (its values were stored, or,
  // for a pair that writes nothing, are in registers)
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 row_s = arrive(T, s, s_writer[0]);
    const u32 row_d = route == ROUTE_DIRECT ? 0u : arrive(T, d, s_writer[1]);
    if (row_s | row_d) __threadfence();  // the writers' arrivals before the staging reads
    s_fin_page[0] = row_s ? s : (i64)-1;
    s_fin_row[0] = row_s - 1u;
    s_fin_page[1] = row_d ? d : (i64)-1;
    s_fin_row[1] = row_d - 1u;
  }
  __syncthreads();
  // step 5, finish: the staging rows of pages whose participants are all done
#pragma unroll 1
  for (int k = 0; k < 2; ++k) {
    const i64 p = s_fin_page[k];
    if (p >= 0) {
      stream_page<VW>(staging + (u64)s_fin_row[k] * (u64)P.page_bytes, page_ptr(P, p), P,
                      threadIdx.x);
    }
  }
}

#define FP4C_COPY_PARAMS \
  const void *__restrict__ src, const void *__restrict__ dst, const PageMoveParams params

// NAME, id type
#define FP4C_PAGE_MARK_KERNEL(NAME, ID)                                                    \
  extern "C" __global__ void __launch_bounds__(FP4C_PAGE_MOVE_THREADS) NAME(FP4C_COPY_PARAMS) { \
    mark_impl<ID>(src, dst, params);                                                       \
  }

// NAME, id type, vector bytes
#define FP4C_PAGE_COPY_KERNEL(NAME, ID, VW)                                                \
  extern "C" __global__ void __launch_bounds__(FP4C_PAGE_MOVE_THREADS, FP4C_COPY_MIN_CTAS)  \
      NAME(FP4C_COPY_PARAMS) {                                                             \
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
