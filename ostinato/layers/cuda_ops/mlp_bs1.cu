// A decoder layer's MLP at one decode row as one kernel (Hopper): h = x + r (the residual add before the
// post-attention norm), y = W_down . act(W_gu . rms(h)), with act = silu(gate) * up. layers/cuda_ops/mlp_bs1.py says
// why and where it runs.
//
// Each block (two an SM by default: mlp_bs1.py's SETTINGS) owns a share of the intermediate rows. Its producer warp
// streams the block's gate rows, up rows and the same rows of W_down^T (a transposed copy of down: [inter, hidden])
// through the ring (ring.cuh) from the kernel's first instruction: weights are no kernel's output, so they are read
// before the PDL wait and stream while the kernel before this one (o_proj) finishes. The consumer warps wait for x,
// stage h, take their gate and up dots, keep act for their rows in shared memory, and multiply it by their rows of
// W_down^T at once (split-K): the block's [hidden] partial of y goes by atomics into one of `copies` fp32
// accumulators (block b into copy b % copies: fewer blocks' atomics meet on an address), so no block waits for
// another. The last block to finish (a count) sums the copies, rounds the sum to bf16 into y and zeroes the copies
// and the count for the next launch.
// Rounding follows the layer's unfused kernels (HF's order): h, gate, up, silu(gate) and act are rounded to bf16; y
// is the fp32 sum of the blocks' partials, rounded once. The partials meet in the order blocks finish, so y varies
// with timing at fp32's rounding (not bit-reproducible).
//
// Layouts: x, r, h_out, y bf16 [hidden]; w_gu bf16 [2 inter, hidden] (gate rows, then up rows; the norm's weight
// folded in, layers/norm_linear.py); w_down_t bf16 [inter, hidden]; acc fp32 [copies][hidden] and count: zero on
// entry, left zero.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ring.cuh"

namespace {

constexpr int kRowsMax = 512;   // most intermediate rows a block may own (gate outputs, then act)
constexpr int kPartMax = 1024;  // most (row, k part) dots of gate or up a block may keep
constexpr int kDownChunks = 2;  // 8-column chunks of y a consumer thread owns: hidden <= 4,096
constexpr int kMaxCopies = 8;   // accumulators the blocks' atomics spread over
enum Op { kGate = 0, kUp = 1, kDown = 2 };
// flags: kTrigger lets the next kernel's blocks be placed beside these from the start (where they fit), else as they
// end; timing probes only (y is void): kNoFinish skips the count and the last block's sum, kRingOnly frees every tile
// unread
constexpr int kTrigger = 1, kNoFinish = 2, kRingOnly = 4;

struct Params {
  const __nv_bfloat16* x;  // o_proj's output
  const __nv_bfloat16* r;  // the residual stream before it
  __nv_bfloat16* h_out;    // x + r: the residual stream after attention (written by block 0)
  __nv_bfloat16* y;        // the MLP's output
  const __nv_bfloat16* w_gu;
  const __nv_bfloat16* w_down_t;
  float* acc;
  unsigned* count;
  int hidden, inter, slots, flags, copies;
  float eps;
};

struct Smem {
  Seg segs[3];          // the block's rows of gate, up and W_down^T (the same row0 in inter)
  __nv_bfloat16* ring;  // slots x kSlotBytes
  uint64_t* full;       // [kMaxSlots]
  uint64_t* empty;      // [kMaxSlots]
  float* xs;            // [hidden]: h
  float* part;          // [its rows x parts]: the dots of gate or up, a (row, part of k) each
  float* rows;          // [its rows]: gate outputs, then act
  float* misc;          // [kWarps + 1]
};

// Floats a block keeps for its (row, part) dots and for its rows (the most any block of the grid owns), rounded up to
// 16 bytes: shared memory is sized to the shape, so that two blocks fit an SM beside their rings.
__host__ __device__ __forceinline__ void buffer_floats(int hidden, int inter, int grid, int& part, int& rows) {
  rows = ((inter + grid - 1) / grid + 3) / 4 * 4;
  part = rows * (kWarps / rows_per_tile(hidden));
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ const __nv_bfloat16* tile_src(const Params& p, const Seg& s, int op, int r) {
  return (op == kDown ? p.w_down_t : p.w_gu) + (size_t)(s.row0 + r) * s.k;
}

// The producer's one thread: the block's tiles of gate, up and W_down^T, each into the next free slot.
__device__ void produce(const Params& p, Smem& sm) {
  RingPos pos;
  for (int op = kGate; op <= kDown; ++op) {
    const Seg& s = sm.segs[op];
    for (int r = 0; r < s.rows; r += s.rpt, pos.next(p.slots)) {
      if (pos.lap > 0) mbar_wait(&sm.empty[pos.slot], (pos.lap - 1) & 1);  // the consumers freed the last lap's
      const uint32_t bytes = (uint32_t)min(s.rpt, s.rows - r) * s.k * 2;
      mbar_expect_tx(&sm.full[pos.slot], bytes);
      bulk_load(sm.ring + (size_t)pos.slot * (kSlotBytes / 2), tile_src(p, s, op, r), bytes, &sm.full[pos.slot]);
    }
  }
}

// xs = h = bf16(x + r) (block 0 also writes it to h_out); returns h's RMSNorm scale. hidden % 8 == 0.
__device__ float stage_h(const Params& p, Smem& sm) {
  const int tid = threadIdx.x;
  float ss = 0.f;
  for (int i = tid * 8; i < p.hidden; i += kConsumers * 8) {
    const uint4 xv = __ldcg(reinterpret_cast<const uint4*>(p.x + i));
    const uint4 rv = __ldcg(reinterpret_cast<const uint4*>(p.r + i));
    const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&xv);
    const __nv_bfloat162* r2 = reinterpret_cast<const __nv_bfloat162*>(&rv);
    uint4 hv;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&hv);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = __bfloat1622float2(x2[e]), b = __bfloat1622float2(r2[e]);
      h2[e] = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
      const float2 h = __bfloat1622float2(h2[e]);
      sm.xs[i + 2 * e] = h.x;
      sm.xs[i + 2 * e + 1] = h.y;
      ss += h.x * h.x + h.y * h.y;
    }
    if (blockIdx.x == 0) *reinterpret_cast<uint4*>(p.h_out + i) = hv;
  }
  ss = warp_sum(ss);
  if ((tid & 31) == 0) sm.misc[tid >> 5] = ss;
  consumer_sync();
  float tot = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tot += sm.misc[w];
  return rsqrtf(tot / p.hidden + p.eps);
}

// The block's gate (op kGate) or up rows: their dots summed in a fixed order, scaled by the norm's, rounded; up's
// rows turn the gate outputs in sm.rows into act.
__device__ void gate_or_up(const Params& p, Smem& sm, int op, RingPos& pos, float scale) {
  const Seg& s = sm.segs[op];
  const int parts = kWarps / s.rpt;
  ring_dots(sm.ring, sm.full, sm.empty, p.slots, pos, s, sm.xs, sm.part, !(p.flags & kRingOnly),
            [](int, uint64_t* bar, unsigned parity) { mbar_wait(bar, parity); });
  consumer_sync();
  for (int i = threadIdx.x; i < s.rows; i += kConsumers) {
    float sum = 0.f;
    for (int c = 0; c < parts; ++c) sum += sm.part[i * parts + c];
    const float v = round_bf16(sum * scale);
    if (op == kGate) {
      sm.rows[i] = v;
    } else {
      const float g = sm.rows[i];
      sm.rows[i] = round_bf16(round_bf16(g / (1.f + __expf(-g))) * v);
    }
  }
  consumer_sync();
}

__device__ void consume(const Params& p, Smem& sm) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // x and r are the kernels' before this one
  const float scale = stage_h(p, sm);
  RingPos pos;
  gate_or_up(p, sm, kGate, pos, scale);
  gate_or_up(p, sm, kUp, pos, scale);
  ring_split_k<kDownChunks>(sm.ring, sm.full, sm.empty, p.slots, pos, sm.segs[kDown], sm.rows,
                            p.acc + (size_t)(blockIdx.x % p.copies) * p.hidden, !(p.flags & kRingOnly),
                            [](int, uint64_t* bar, unsigned parity) { mbar_wait(bar, parity); });
  if (p.flags & kNoFinish) return;
  // the last block to count its partial in (acq_rel: it sees every other block's) writes y and clears for the next
  __threadfence();
  consumer_sync();
  if (threadIdx.x == 0) sm.misc[kWarps] = add_acq_rel(p.count, 1u) == gridDim.x - 1u ? 1.f : 0.f;
  consumer_sync();
  if (sm.misc[kWarps] == 0.f) return;
  for (int i = threadIdx.x * 4; i < p.hidden; i += kConsumers * 4) {
    float4 c[kMaxCopies];  // every copy's load in flight together
#pragma unroll
    for (int r = 0; r < kMaxCopies; ++r)
      if (r < p.copies) c[r] = __ldcg(reinterpret_cast<const float4*>(p.acc + (size_t)r * p.hidden + i));
    float4 v = c[0];
#pragma unroll
    for (int r = 1; r < kMaxCopies; ++r)
      if (r < p.copies) v = make_float4(v.x + c[r].x, v.y + c[r].y, v.z + c[r].z, v.w + c[r].w);
#pragma unroll
    for (int r = 0; r < kMaxCopies; ++r)
      if (r < p.copies) *reinterpret_cast<float4*>(p.acc + (size_t)r * p.hidden + i) = make_float4(0.f, 0.f, 0.f, 0.f);
    __nv_bfloat162* y2 = reinterpret_cast<__nv_bfloat162*>(p.y + i);
    y2[0] = __floats2bfloat162_rn(v.x, v.y);
    y2[1] = __floats2bfloat162_rn(v.z, v.w);
  }
  if (threadIdx.x == 0) *p.count = 0u;
}

__global__ void __launch_bounds__(kThreads, 1) mlp_bs1_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ Smem sm;
  if (threadIdx.x == 0) {
    sm.ring = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    sm.full = reinterpret_cast<uint64_t*>(smem_raw + (size_t)p.slots * kSlotBytes);
    sm.empty = sm.full + kMaxSlots;
    sm.xs = reinterpret_cast<float*>(sm.empty + kMaxSlots);
    sm.part = sm.xs + p.hidden;
    int part_floats, rows_floats;
    buffer_floats(p.hidden, p.inter, gridDim.x, part_floats, rows_floats);
    sm.rows = sm.part + part_floats;
    sm.misc = sm.rows + rows_floats;
    for (int i = 0; i < p.slots; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    int r0, r1;
    share(p.inter, blockIdx.x, gridDim.x, r0, r1);
    const int rpt = rows_per_tile(p.hidden);
    sm.segs[kGate] = {r0, r1 - r0, p.hidden, rpt};
    sm.segs[kUp] = {p.inter + r0, r1 - r0, p.hidden, rpt};
    sm.segs[kDown] = {r0, r1 - r0, p.hidden, rpt};
  }
  __syncthreads();
  if (p.flags & kTrigger) asm volatile("griddepcontrol.launch_dependents;");
  if (threadIdx.x >= kConsumers) {
    if (threadIdx.x == kConsumers) produce(p, sm);
  } else {
    consume(p, sm);
  }
}

}  // namespace

extern "C" {

// Shared-memory bytes a block of `grid` uses for `slots` ring slots at this shape.
int ost_mlp_bs1_smem_bytes(int slots, int hidden, int inter, int grid) {
  int part, rows;
  buffer_floats(hidden, inter, grid, part, rows);
  return slots * kSlotBytes + 2 * kMaxSlots * 8 + (hidden + part + rows + kWarps + 1) * 4;
}

int ost_mlp_bs1_limits(int which) {  // the constants the host side checks shapes against
  const int v[] = {kSlotBytes, kMaxSlots, kRowsMax, kPartMax, kDownChunks * 8 * kConsumers, kWarps, kMaxCopies};
  return which >= 0 && which < 7 ? v[which] : -1;
}

// Launches the MLP on `stream` under PDL (graph capture records it); returns a cudaError_t.
int ost_mlp_bs1_launch(const void* x, const void* r, void* h_out, void* y, const void* w_gu, const void* w_down_t,
                       void* acc, void* count, int hidden, int inter, int slots, int grid, int flags, int copies,
                       float eps, void* stream) {
  Params p;
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.r = static_cast<const __nv_bfloat16*>(r);
  p.h_out = static_cast<__nv_bfloat16*>(h_out);
  p.y = static_cast<__nv_bfloat16*>(y);
  p.w_gu = static_cast<const __nv_bfloat16*>(w_gu);
  p.w_down_t = static_cast<const __nv_bfloat16*>(w_down_t);
  p.acc = static_cast<float*>(acc);
  p.count = static_cast<unsigned*>(count);
  p.hidden = hidden;
  p.inter = inter;
  p.slots = slots;
  p.flags = flags;
  p.copies = copies;
  p.eps = eps;
  return (int)launch_ring_kernel(mlp_bs1_kernel, grid, ost_mlp_bs1_smem_bytes(slots, hidden, inter, grid), stream,
                                 true, p);
}

const char* ost_mlp_bs1_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

}  // extern "C"
