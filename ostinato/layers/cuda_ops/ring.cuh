// The pieces of a weight-streaming kernel that both Hopper CUDA kernels here share (layers/cuda_ops/mlp_bs1.cu and
// megakernel/decode_bs1.cu): a block is kWarps consumer warps and one producer warp; the producer streams the
// block's rows of a weight matrix, a tile of rows_per_tile(k) rows at a time, into a ring of kSlotBytes shared-memory
// slots by bulk copies (completion on the slot's `full` mbarrier, its transaction count the tile's bytes); each
// consumer warp frees a slot by one arrive on its `empty` mbarrier. A warp takes one (row, part of k) of every tile,
// holding its columns of the input vector in registers (HeldX), and reduces kTileGroup tiles' dots at once.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kWarps = 8;  // consumer warps
constexpr int kConsumers = kWarps * 32;
constexpr int kThreads = kConsumers + 32;  // + the producer warp
constexpr int kSlotBytes = 16384;
constexpr int kMaxSlots = 16;
constexpr int kTileGroup = 4;  // tiles a warp takes before one reduction of their dots

struct Seg {       // a block's rows of one operation's matrix
  int row0, rows;  // rows [row0, row0 + rows) of the matrix
  int k, rpt;      // their width, and rows a weight tile (rows_per_tile(k))
};

// ------------------------------------------------------------------ PTX helpers
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n MBAR_WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra MBAR_WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory"); }

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned add_acq_rel(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float bf(const __nv_bfloat16 x) { return __bfloat162float(x); }

__host__ __device__ __forceinline__ void share(int n, int b, int g, int& r0, int& r1) {
  r0 = (int)((int64_t)n * b / g);
  r1 = (int)((int64_t)n * (b + 1) / g);
}

// Rows a weight tile holds: as many as fill a slot, a power of two, at most one a consumer warp.
__host__ __device__ __forceinline__ int rows_per_tile(int k) {
  int r = min(kSlotBytes / (2 * k), kWarps);
  int p = 1;
  while (p * 2 <= r) p *= 2;
  return p;
}

// A walker's place in the ring: the slot and the parity of its current lap (both roles walk the same tiles in order).
struct RingPos {
  int slot = 0;
  unsigned lap = 0;
  __device__ __forceinline__ void next(int slots) {
    if (++slot == slots) {
      slot = 0;
      ++lap;
    }
  }
};

// Every tile holds rows_per_tile(k) <= kWarps rows, and a row is taken by parts = kWarps / rows_per_tile warps,
// each a slice of k (span <= 1,024 columns). So a warp takes one (row, part) of each tile, and each lane holds its
// columns of x in registers for the whole operation, 8 at each 256.
struct HeldX {
  float v[4][8];
};

__device__ __forceinline__ HeldX hold_x(const float* xs, int k0, int span, int lane) {
  HeldX x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int kk = lane * 8 + 256 * i;
    const float4 a = kk < span ? *reinterpret_cast<const float4*>(xs + k0 + kk) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 b = kk < span ? *reinterpret_cast<const float4*>(xs + k0 + kk + 4) : make_float4(0.f, 0.f, 0.f, 0.f);
    x.v[i][0] = a.x, x.v[i][1] = a.y, x.v[i][2] = a.z, x.v[i][3] = a.w;
    x.v[i][4] = b.x, x.v[i][5] = b.y, x.v[i][6] = b.z, x.v[i][7] = b.w;
  }
  return x;
}

// The lane's share of row[0, span) . x (row: the slice's first column in the tile). Its four 16-byte loads are
// issued before any is used; a lane's columns past the span read the row's first ones instead, times x's zeros.
__device__ __forceinline__ float lane_dot(const __nv_bfloat16* row, const HeldX& x, int span, int lane) {
  uint4 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int kk = lane * 8 + 256 * i;
    w[i] = *reinterpret_cast<const uint4*>(row + (kk < span ? kk : 0));
  }
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w[i]);
    const float2 f0 = __bfloat1622float2(w2[0]), f1 = __bfloat1622float2(w2[1]);
    const float2 f2 = __bfloat1622float2(w2[2]), f3 = __bfloat1622float2(w2[3]);
    a0 = fmaf(f0.x, x.v[i][0], a0);
    a1 = fmaf(f0.y, x.v[i][1], a1);
    a2 = fmaf(f1.x, x.v[i][2], a2);
    a3 = fmaf(f1.y, x.v[i][3], a3);
    a0 = fmaf(f2.x, x.v[i][4], a0);
    a1 = fmaf(f2.y, x.v[i][5], a1);
    a2 = fmaf(f3.x, x.v[i][6], a2);
    a3 = fmaf(f3.y, x.v[i][7], a3);
  }
  return (a0 + a1) + (a2 + a3);
}

// Four values summed over the warp at once (6 shuffles, 5 deep, where four warp sums take 20): lane l gets the sum
// of v[l >> 3]. Each halving step keeps the half of the values its side of the exchange owns.
__device__ __forceinline__ float warp_sum4(const float (&v)[kTileGroup], int lane) {
  const bool hi = lane & 16, mid = lane & 8;
  float s0 = (hi ? v[2] : v[0]) + __shfl_xor_sync(0xffffffffu, hi ? v[0] : v[2], 16);
  float s1 = (hi ? v[3] : v[1]) + __shfl_xor_sync(0xffffffffu, hi ? v[1] : v[3], 16);
  float s = (mid ? s1 : s0) + __shfl_xor_sync(0xffffffffu, mid ? s0 : s1, 8);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// ------------------------------------------------------------------ the two ways a block consumes its tiles
// The dots of one operation's rows, tile by tile from the ring: part[row * parts + c] = the row . x over part c of k,
// for each of the segment's rows (parts = kWarps / s.rpt; x staged in xs). A warp takes its (row, part) of kTileGroup
// tiles, freeing each slot once read, then reduces their dots together. wait(t, bar, parity) waits for tile t's slot
// (so a caller can time it); with `read` false the tiles are freed unread (timing probes).
template <class Wait>
__device__ __forceinline__ void ring_dots(const __nv_bfloat16* ring, uint64_t* full, uint64_t* empty, int slots,
                                          RingPos& pos, const Seg& s, const float* xs, float* part, bool read,
                                          Wait wait) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpt = s.rpt, parts = kWarps / rpt, span = s.k / parts;
  const int rr = warp / parts, c = warp % parts;  // the warp's row in every tile and its part of k
  const int tiles = (s.rows + rpt - 1) / rpt;
  const HeldX x = hold_x(xs, c * span, span, lane);
  for (int t0 = 0; t0 < tiles; t0 += kTileGroup) {
    float v[kTileGroup];
#pragma unroll
    for (int u = 0; u < kTileGroup; ++u) {
      v[u] = 0.f;
      if (t0 + u < tiles) {
        wait(t0 + u, &full[pos.slot], pos.lap & 1);
        const __nv_bfloat16* tile = ring + (size_t)pos.slot * (kSlotBytes / 2);
        if (read && (t0 + u) * rpt + rr < s.rows) v[u] = lane_dot(tile + (size_t)rr * s.k + c * span, x, span, lane);
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[pos.slot]);
        pos.next(slots);
      }
    }
    const float y = warp_sum4(v, lane);
    const int row = (t0 + (lane >> 3)) * rpt + rr;
    if ((lane & 7) == 0 && t0 + (lane >> 3) < tiles && row < s.rows) part[row * parts + c] = y;
  }
}

// Split-K: dst[0, s.k) += sum over the segment's rows r of act[r] * row r (rows of a transposed matrix, W^T[r, :]),
// tile by tile from the ring. A consumer thread owns Chunks 8-column chunks (tid, tid + kConsumers, ...; s.k <=
// Chunks x 8 x kConsumers) and takes them from every row of a tile, so its sums need no reduction; they go into dst
// by 16-byte fp32 atomics (red) at the end. wait and read as ring_dots'.
template <int Chunks, class Wait>
__device__ __forceinline__ void ring_split_k(const __nv_bfloat16* ring, uint64_t* full, uint64_t* empty, int slots,
                                             RingPos& pos, const Seg& s, const float* act, float* dst, bool read,
                                             Wait wait) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int tiles = (s.rows + s.rpt - 1) / s.rpt, chunks = s.k / 8;
  float acc[Chunks][8];
#pragma unroll
  for (int u = 0; u < Chunks; ++u)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
  for (int t = 0; t < tiles; ++t) {
    wait(t, &full[pos.slot], pos.lap & 1);
    const __nv_bfloat16* tile = ring + (size_t)pos.slot * (kSlotBytes / 2);
    const int r0 = t * s.rpt, n = min(s.rpt, s.rows - r0);  // rpt <= kWarps
#pragma unroll
    for (int u = 0; u < Chunks; ++u) {
      const int c = tid + u * kConsumers;
      if (c < chunks && read) {
#pragma unroll 1
        for (int r4 = 0; r4 < kWarps; r4 += 4) {  // four rows' loads in flight at a time (registers: 168 at most)
          uint4 w[4];
#pragma unroll
          for (int r = 0; r < 4; ++r)
            if (r4 + r < n) w[r] = *reinterpret_cast<const uint4*>(tile + (size_t)(r4 + r) * s.k + c * 8);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (r4 + r < n) {
              const float a = act[r0 + r4 + r];
              const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&w[r]);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float2 f = __bfloat1622float2(w2[e]);
                acc[u][2 * e] = fmaf(a, f.x, acc[u][2 * e]);
                acc[u][2 * e + 1] = fmaf(a, f.y, acc[u][2 * e + 1]);
              }
            }
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[pos.slot]);
    pos.next(slots);
  }
#pragma unroll
  for (int u = 0; u < Chunks; ++u) {
    const int c = tid + u * kConsumers;
    if (c < chunks && read) {
      float4* out = reinterpret_cast<float4*>(dst + c * 8);
      atomicAdd(out, make_float4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]));
      atomicAdd(out + 1, make_float4(acc[u][4], acc[u][5], acc[u][6], acc[u][7]));
    }
  }
}

// Launches `kernel` with `grid` blocks of kThreads and `smem` bytes of dynamic shared memory on `stream`, under
// Programmatic Dependent Launch where `pdl` (its blocks may be placed while the kernel before it finishes; they wait
// for it at griddepcontrol.wait). Graph capture records it.
template <typename... Expected, typename... Actual>
cudaError_t launch_ring_kernel(void (*kernel)(Expected...), int grid, int smem, void* stream, bool pdl,
                               Actual&&... args) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Actual&&>(args)...);
}

}  // namespace
