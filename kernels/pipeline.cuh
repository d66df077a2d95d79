// fp4cache: the pipeline primitives of the warp-specialized wgmma kernel (varlen_wgmma.cu,
// sm_90a): shared-memory mbarriers (a stage's full / empty barrier, waited on by phase
// parity), the per-stage ring counter, and the register moves between warpgroups
// (setmaxnreg).  Named barriers (NamedBar) are attn_ptx.cuh's.
#pragma once
#include "fp4_common.cuh"

// mbarrier at shared address bar, expecting `count` arrivals per phase (one thread, before
// a barrier of the CTA)
FP4C_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// This thread's arrival (release: its writes before it are seen by the waiters)
FP4C_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar)
               : "memory");
}
// Wait until the phase of parity `parity` has completed (acquire)
FP4C_DEVICE void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// The position of a ring of S stages: stage i % S of the i-th use, phase (i / S) % 2.  The
// consumer of a use waits for its full barrier's phase `phase`; its producer waits for
// the empty barrier's phase `phase ^ 1` (the previous use's release; the first use of a
// stage passes: a fresh barrier's phase of parity 1 counts as completed).
template <int S>
struct Ring {
  u32 stage = 0u, phase = 0u;
  FP4C_DEVICE void next() {
    if (++stage == (u32)S) {
      stage = 0u;
      phase ^= 1u;
    }
  }
};

// Give registers back to the pool (producer warpgroups) or take them (consumers): every
// warp of a warpgroup runs it with the same N (a multiple of 8, 24..256); the kernel's
// __launch_bounds__ fixes the count the warps start with
template <int N>
FP4C_DEVICE void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
FP4C_DEVICE void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
