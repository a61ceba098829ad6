// One-launch decode step for one request: every decoder layer of a Llama-family model (Llama, Qwen2, Qwen3) in a
// single persistent kernel, a block an SM (ostinato/megakernel/__init__.py says why and when it runs).
//
// A block is 8 consumer warps and one producer warp. The producer streams the block's share of every weight
// matrix, layer after layer, into a ring of shared-memory slots by bulk copies (cp.async.bulk, completion on an
// mbarrier a slot); it never waits for activations, only for a free slot, so HBM keeps streaming while the
// consumers wait on the step's data dependencies; except that it holds its copies from the end of QKV, O or DOWN
// until the next operation's dependency is met and its input staged (`hold`), where a refill slowed the hand-off
// (docs/gpu-notes.md, fifty-fourth and fifty-sixth sessions). The consumers run the layer as five operations:
//   QKV   rows of W_qkv . rms(h)                  -> qkv (fp32)        then count QKV += 1
//   ATTN  (kv head, split) items: q/k norm, rotary, the new K/V stored, softmax over the split's keys; the last
//         split of a head to finish merges the head's splits       -> attn (fp32)       then count ATTN += 1
//   O     rows of W_o . attn, added to the residual stream: h and h_mid                  then count O += 1
//   GU    gate rows and up rows of W_gu . rms(h_mid) -> the block's act = silu(gate) * up, kept in shared memory
//   DOWN  split-K: the block's act times the same rows of W_down^T, a [hidden] partial added by fp32 atomics into
//         one of h's copies (h is their sum: fewer blocks' atomics meet on an address)   then count DOWN += 1
// after the last layer's DOWN is counted, every block writes its rows of x_out (bf16) from h.
// QKV, O and GU wait for the operation before them to be counted complete by every block (or every kv head), by
// one thread's gpu-scope acquire poll; DOWN needs only its own block's act, so a layer has three grid-wide waits.
// Counts only grow: a launch reads the epoch (launches so far) and waits for (epoch + 1) x the target, compared
// modulo 2^32; the last block to leave advances the epoch. So no memset a step.
// Every row of QKV, O and GU's outputs is one block's, its warps' parts of k summed in a fixed order; DOWN's partials
// meet in h by atomics in the order blocks finish, so the step's result varies with timing at fp32's rounding (the
// fifty-sixth session traded bit-reproducibility for a grid-wide wait a layer: docs/gpu-notes.md).
// h_mid is O's copy of the residual stream that GU's input norm reads while other blocks' DOWN already add into h.
// Activations the kernel produces are read with ld.global.cg (L2), never L1.
//
// Layouts: weights row-major [out, in] bf16, contiguous, 16-byte aligned, but W_down^T [inter, hidden]; W_qkv's
// rows q, k, v; W_gu's rows gate then up; the input and post-attention norms' weights already folded into W_qkv and
// W_gu (layers/norm_linear.py).
// KV cache bf16 [slot, kv head, head dim] (token-major); req_to_token int32 [rows, stride]; cos_sin float32
// [positions, head dim] (cos halves then sin halves, NeoX rotation).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "ring.cuh"

namespace {

constexpr int kCountStride = 32;              // counters a layer: QKV, ATTN, O, DOWN, then one a kv head
constexpr int kGateMax = 512;                 // rows a block holds: gate outputs until their up rows come (then act,
                                              // DOWN's rows), or the residual stream's rows that O adds to
constexpr int kMinSplitTokens = 32;           // cached keys a split takes at least (fewer splits at short contexts)
constexpr int kPartMax = 1024;                // a block's row x part sums of one operation (rows x warps a row)
constexpr int kDownChunks = 2;                // DOWN: 8-column chunks of h a consumer thread owns (hidden <= 4,096)
constexpr int kMaxHCopies = 8;                // copies of h that DOWN's atomics spread over (Params::h_copies)

enum Count { kQkv = 0, kAttn = 1, kO = 2, kDown = 3, kHead = 4 };
enum Op { kOpQkv = 0, kOpO = 1, kOpGate = 2, kOpUp = 3, kOpDown = 4 };
// trace stamps a layer: an operation's dependency met, its first weight tile in, its end (QKV 0-2, O 6-8, GU 9-11,
// DOWN 12-14); attention 3-5: its wait met, its split done, the item done (merged or not)
// 16-20: ns a block's consumers waited on weight tiles in QKV, O, gate, up, DOWN
constexpr int kTraceSlots = 24;
constexpr int kNoWaits = 1;  // flags: no operation waits for the one before (timing probes only)
constexpr int kRingOnly = 2;  // flags: consumers take each tile and free it without reading it (timing probes only)

struct Layer {
  const __nv_bfloat16* w_qkv;
  const __nv_bfloat16* w_o;
  const __nv_bfloat16* w_gu;
  const __nv_bfloat16* w_down_t;  // [inter, hidden]: DOWN's rows are a block's act rows
  const __nv_bfloat16* b_qkv;   // or null
  const __nv_bfloat16* q_norm;  // or null (no per-head q/k norm)
  const __nv_bfloat16* k_norm;
  __nv_bfloat16* k_cache;
  __nv_bfloat16* v_cache;
};

struct Params {
  const Layer* layers;
  int num_layers, hidden, heads, kv_heads, head_dim, inter, splits, slots, h_copies;
  float eps, qk_eps, scale_log2;
  const __nv_bfloat16* x_in;
  __nv_bfloat16* x_out;
  const int64_t* positions;
  const int64_t* seq_lens;
  const int64_t* req_rows;
  const int64_t* out_loc;
  const int32_t* req_to_token;
  int64_t table_stride;
  const float* cos_sin;
  float* h;      // [h_copies][hidden] the residual stream as the sum of its copies: O writes it (copy 0; zeros in the
                 // rest), block b's DOWN adds into copy b % h_copies, QKV and O read the sum
  float* qkv;    // [q + 2 kv]
  float* attn;   // [heads x head_dim]
  float* h_mid;  // [hidden] O's copy of h: GU's input
  float* part;   // [kv_heads x splits x group x (head_dim + 2)]: a split's unnormalised output, max, sum
  unsigned* counters;  // [num_layers x kCountStride], then exits, then the epoch
  unsigned long long* trace;  // null, or [blocks][num_layers][kTraceSlots] %globaltimer stamps (probe_megakernel.py)
  int flags;                  // kNoWaits, kRingOnly: a timing probe's (the outputs are void)
};



// One consumer thread waits until *count reaches target (mod 2^32); then the consumers go on together.
// (The acquire load orders the block's later reads after the counted writes: the CTA barrier carries that to the
// other consumer threads, as a grid barrier does.)
__device__ __forceinline__ void wait_count(const Params& p, const unsigned* count, unsigned target) {
  if (threadIdx.x == 0 && !(p.flags & kNoWaits)) {
    while ((int)(load_acquire(count) - target) < 0) {
    }
  }
  consumer_sync();
}

// After every consumer has written its outputs: one thread counts the operation done. The release add is cumulative:
// it publishes the writes the CTA barrier ordered before it, not only the thread's own.
__device__ __forceinline__ void signal_count(unsigned* count) {
  consumer_sync();
  if (threadIdx.x == 0) add_release(count, 1u);
}


__device__ __forceinline__ void stamp(const Params& p, int layer, int slot, unsigned long long t) {
  if (p.trace && threadIdx.x == 0) p.trace[((size_t)blockIdx.x * p.num_layers + layer) * kTraceSlots + slot] = t;
}
__device__ __forceinline__ void stamp(const Params& p, int layer, int slot) {
  if (p.trace) stamp(p, layer, slot, now());
}


// ------------------------------------------------------------------ the schedule both roles walk

// Block b's rows of each operation (of g blocks), computed once a launch.
__device__ void block_segments(const Params& p, int b, int g, Seg* segs) {
  const int q = p.heads * p.head_dim, kv = p.kv_heads * p.head_dim;
  const int rows[5] = {q + 2 * kv, p.hidden, p.inter, p.inter, p.inter};  // DOWN: the block's act rows of W_down^T
  const int ks[5] = {p.hidden, q, p.hidden, p.hidden, p.hidden};
  for (int op = 0; op < 5; ++op) {
    int r0, r1;
    share(rows[op], b, g, r0, r1);
    segs[op] = {r0 + (op == kOpUp ? p.inter : 0), r1 - r0, ks[op], rows_per_tile(ks[op])};  // GATE, UP, DOWN: same r0
  }
}

__device__ __forceinline__ const __nv_bfloat16* matrix(const Layer& L, int op) {
  switch (op) {
    case kOpQkv:
      return L.w_qkv;
    case kOpO:
      return L.w_o;
    case kOpGate:
    case kOpUp:
      return L.w_gu;
    default:
      return L.w_down_t;
  }
}

// ------------------------------------------------------------------ shared memory
struct Smem {
  Seg* segs;            // [5] the block's rows of each operation
  __nv_bfloat16* ring;  // slots x kSlotBytes
  uint64_t* full;       // [kMaxSlots]
  uint64_t* empty;      // [kMaxSlots]
  float* xs;            // the operation's input vector, or attention's scratch
  float* part;          // [kPartMax]: the operation's dots, a (block row, k part) each, summed at its end
  float* rows;          // [kGateMax]: the block's residual rows (O), gate outputs, then act (GU, read by DOWN)
  float* misc;          // [kWarps + 4]
  unsigned* hold;       // set by the consumers across a hand-off (hold()): the producer holds its copies
};

// The producer holds its copies (1) or goes on (0): set once QKV's, O's or DOWN's tiles are all read, cleared once
// the next operation's wait is met (attention) or its input staged (O, gate, QKV), so the count's release, its poll
// and the staging's reads do not queue behind a refill.
__device__ __forceinline__ void hold(Smem& sm, unsigned on) {
  if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned*>(sm.hold) = on;
}


// ------------------------------------------------------------------ the producer
// A place in the block's tile sequence: layer after layer, operation after operation, rpt rows a tile.
struct Walk {
  int layer = 0, op = 0, r = 0;
  __device__ __forceinline__ bool done(const Params& p) const { return layer >= p.num_layers; }
  __device__ __forceinline__ void settle(const Params& p, const Seg* segs) {  // past operations with no rows left
    while (!done(p) && r >= segs[op].rows) {
      r = 0;
      if (++op == 5) {
        op = 0;
        ++layer;
      }
    }
  }
  __device__ __forceinline__ void next(const Params& p, const Seg* segs) {
    r += segs[op].rpt;
    settle(p, segs);
  }
  __device__ __forceinline__ const __nv_bfloat16* src(const Params& p, const Seg* segs, uint32_t& bytes) const {
    const Seg& s = segs[op];
    bytes = (uint32_t)min(s.rpt, s.rows - r) * s.k * 2;
    return matrix(p.layers[layer], op) + (size_t)(s.row0 + r) * s.k;
  }
};

// The producer's one thread: each tile into the next free slot by one bulk copy. (Asking L2 for tiles further ahead,
// cp.async.bulk.prefetch.L2, slowed every step: docs/gpu-notes.md, fifty-third session.)
__device__ void produce(const Params& p, Smem& sm) {
  const int ns = p.slots;
  Walk load;
  load.settle(p, sm.segs);
  uint32_t bytes;
  for (RingPos pos; !load.done(p); load.next(p, sm.segs), pos.next(ns)) {
    if (pos.lap > 0) mbar_wait(&sm.empty[pos.slot], (pos.lap - 1) & 1);  // the consumers freed the last lap's
    while (*reinterpret_cast<volatile unsigned*>(sm.hold)) {
    }
    const __nv_bfloat16* src = load.src(p, sm.segs, bytes);
    mbar_expect_tx(&sm.full[pos.slot], bytes);
    bulk_load(sm.ring + (size_t)pos.slot * (kSlotBytes / 2), src, bytes, &sm.full[pos.slot]);
  }
}

// ------------------------------------------------------------------ consumer pieces
// Reads n floats (n a multiple of 4, at most 8 x 4 x kConsumers = 8192) from L2 into xs: every load issued before
// any is used (one round trip, not one a loop turn). Returns the sum of squares of the thread's values.
__device__ __forceinline__ float stage(Smem& sm, const float* src, int n) {
  const int tid = threadIdx.x;
  float4 v[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int i = (u * kConsumers + tid) * 4;
    v[u] = i < n ? __ldcg(reinterpret_cast<const float4*>(src + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncwarp();  // every load issued before the first store: ptxas otherwise moved stores up between them (SASS)
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int i = (u * kConsumers + tid) * 4;
    if (i < n) *reinterpret_cast<float4*>(sm.xs + i) = v[u];
    ss += v[u].x * v[u].x + v[u].y * v[u].y + v[u].z * v[u].z + v[u].w * v[u].w;
  }
  return ss;
}

// The same from bf16 (the step's input row), 8 values a load.
__device__ __forceinline__ float stage(Smem& sm, const __nv_bfloat16* src, int n) {
  const int tid = threadIdx.x;
  uint4 v[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int i = (u * kConsumers + tid) * 8;
    v[u] = i < n ? *reinterpret_cast<const uint4*>(src + i) : make_uint4(0u, 0u, 0u, 0u);
  }
  float ss = 0.f;
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int i = (u * kConsumers + tid) * 8;
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(b[e]);
      if (i < n) {
        sm.xs[i + 2 * e] = f.x;
        sm.xs[i + 2 * e + 1] = f.y;
      }
      ss += f.x * f.x + f.y * f.y;
    }
  }
  return ss;
}

// Element i of the residual stream: the sum of h's copies.
__device__ __forceinline__ float h_at(const Params& p, int i) {
  float v[kMaxHCopies];
#pragma unroll
  for (int r = 0; r < kMaxHCopies; ++r) v[r] = r < p.h_copies ? __ldcg(p.h + (size_t)r * p.hidden + i) : 0.f;
  float sum = 0.f;
#pragma unroll
  for (int r = 0; r < kMaxHCopies; ++r) sum += v[r];
  return sum;
}

// xs = the residual stream (h's copies summed, every copy's load in flight together); returns the thread's sum of
// squares. hidden <= 4 x 4 x kConsumers.
__device__ __forceinline__ float stage_h(const Params& p, Smem& sm) {
  float ss = 0.f;
#pragma unroll 1
  for (int i = threadIdx.x * 4; i < p.hidden; i += kConsumers * 4) {
    float4 v[kMaxHCopies];
#pragma unroll
    for (int r = 0; r < kMaxHCopies; ++r)
      v[r] = r < p.h_copies ? __ldcg(reinterpret_cast<const float4*>(p.h + (size_t)r * p.hidden + i))
                            : make_float4(0.f, 0.f, 0.f, 0.f);
    float4 a = v[0];
#pragma unroll
    for (int r = 1; r < kMaxHCopies; ++r) a = make_float4(a.x + v[r].x, a.y + v[r].y, a.z + v[r].z, a.w + v[r].w);
    *reinterpret_cast<float4*>(sm.xs + i) = a;
    ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
  }
  return ss;
}

// The RMSNorm scale of the n values staged in xs from every consumer thread's sum of squares ss.
__device__ float norm_scale(Smem& sm, float ss, int n, float eps) {
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) sm.misc[threadIdx.x >> 5] = ss;
  consumer_sync();
  float tot = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tot += sm.misc[w];
  return rsqrtf(tot / n + eps);
}

// xs = v over n values; returns rsqrt(mean(v^2) + eps), the row's RMSNorm scale, which the GEMV applies to its
// outputs (a scale commutes with the map; the norm's weight is folded into the matrix).
template <typename T>
__device__ float load_normed(Smem& sm, const T* src, int n, float eps) {
  return norm_scale(sm, stage(sm, src, n), n, eps);
}

// xs = src[0, n), and the block's rows of the residual stream (O's rows; of x_in: the first layer's O) into sm.rows,
// the loads of both in flight together.
__device__ void load_plain(const Params& p, Smem& sm, const float* src, int n, bool from_x_in) {
  const int tid = threadIdx.x, r0 = sm.segs[kOpO].row0;
  const bool mine = tid < sm.segs[kOpO].rows;
  float res = 0.f;
  if (mine) res = from_x_in ? bf(p.x_in[r0 + tid]) : h_at(p, r0 + tid);
  stage(sm, src, n);
  if (mine) sm.rows[tid] = res;
  consumer_sync();
}


__device__ __forceinline__ void epilogue(const Params& p, const Layer& L, Smem& sm, int op, int row, int local,
                                         float y) {
  switch (op) {
    case kOpQkv:
      p.qkv[row] = y + (L.b_qkv ? bf(L.b_qkv[row]) : 0.f);
      break;
    case kOpO: {
      const float v = sm.rows[local] + y;
      p.h[row] = v;
      for (int r = 1; r < p.h_copies; ++r) p.h[(size_t)r * p.hidden + row] = 0.f;
      p.h_mid[row] = v;
      break;
    }
    case kOpGate:
      sm.rows[local] = y;
      break;
    default: {  // up: the row's act replaces its gate output
      const float gt = sm.rows[local];
      sm.rows[local] = gt / (1.f + __expf(-gt)) * y;
    }
  }
}

// The block's rows of one operation, tile by tile from the ring (ring_dots); at the end every row's parts are summed
// in a fixed order (the result does not depend on timing) and the epilogue runs a row a thread. `scale` multiplies
// every dot (the input's RMSNorm scale, or 1).
__device__ void gemv(const Params& p, const Layer& L, Smem& sm, int op, int layer, RingPos& pos, int first_stamp,
                     float scale) {
  const Seg s = sm.segs[op];
  const int parts = kWarps / s.rpt;
  unsigned long long waited = 0;
  ring_dots(sm.ring, sm.full, sm.empty, p.slots, pos, s, sm.xs, sm.part, !(p.flags & kRingOnly),
            [&](int t, uint64_t* bar, unsigned parity) {
              const unsigned long long t_wait = p.trace ? now() : 0;
              mbar_wait(bar, parity);
              if (p.trace) waited += now() - t_wait;
              if (t == 0 && first_stamp >= 0) stamp(p, layer, first_stamp);
            });
  consumer_sync();
  for (int i = threadIdx.x; i < s.rows; i += kConsumers) {
    float sum = 0.f;
    for (int c2 = 0; c2 < parts; ++c2) sum += sm.part[i * parts + c2];
    epilogue(p, L, sm, op, s.row0 + i, i, sum * scale);
  }
  stamp(p, layer, 16 + op, waited);
  consumer_sync();
}

// DOWN as split-K: h += W_down^T[rows]^T . act[rows] over the block's act rows (sm.rows, GU's), into the block's copy
// of h (ring_split_k).
__device__ void down_split_k(const Params& p, Smem& sm, int layer, RingPos& pos) {
  unsigned long long waited = 0;
  ring_split_k<kDownChunks>(sm.ring, sm.full, sm.empty, p.slots, pos, sm.segs[kOpDown], sm.rows,
                            p.h + (size_t)(blockIdx.x % p.h_copies) * p.hidden, !(p.flags & kRingOnly),
                            [&](int t, uint64_t* bar, unsigned parity) {
                              const unsigned long long t_wait = p.trace ? now() : 0;
                              mbar_wait(bar, parity);
                              if (p.trace) waited += now() - t_wait;
                              if (t == 0) stamp(p, layer, 13);
                            });
  stamp(p, layer, 16 + kOpDown, waited);
}

// rms-normalise (optional weight) and rotate one head of d values held in smem x, by one warp.
template <int D>
__device__ __forceinline__ void norm_rope(float* x, const __nv_bfloat16* w, float eps, const float* cs, int lane) {
  constexpr int E = D / 32;
  if (w) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) ss += x[lane + 32 * e] * x[lane + 32 * e];
    const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int e = 0; e < E; ++e) x[lane + 32 * e] *= inv * bf(w[lane + 32 * e]);
    __syncwarp();
  }
#pragma unroll
  for (int e = 0; e < E / 2; ++e) {
    const int i = lane + 32 * e;  // < D / 2
    const float a = x[i], b2 = x[i + D / 2], c = cs[i], s = cs[i + D / 2];
    __syncwarp();
    x[i] = a * c - b2 * s;
    x[i + D / 2] = b2 * c + a * s;
  }
  __syncwarp();
}

// One split's keys (and in the last used split the new token) for KV head j: the split's unnormalised output,
// max and sum a query head into p.part. Scratch in sm.xs: q [G][D] (scaled to log2 units), k_new [D], v_new [D],
// then each warp's state [kWarps][G][D + 2].
template <int D, int G>
__device__ void attend_split(const Params& p, const Layer& L, Smem& sm, int layer, int j, int s, int used,
                             int cached, unsigned epoch) {
  constexpr int LPT = D / 8;     // lanes a key (8 dims a lane)
  constexpr int TPP = 32 / LPT;  // keys a warp pass
  constexpr int U = 4;           // passes in flight
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, tid = threadIdx.x;
  const int q_size = p.heads * D, kv_size = p.kv_heads * D;
  float* qs = sm.xs;
  float* kn = qs + G * D;
  float* vn = kn + D;
  float* ws = vn + D;
  const int64_t req = p.req_rows[0];
  const int chunk = (cached + used - 1) / used;
  const int t0 = s * chunk, t1 = min(cached, t0 + chunk);
  const int32_t* table = p.req_to_token + req * p.table_stride;
  const int sub = lane / LPT, dl = (lane % LPT) * 8;  // a lane's key in the pass and its 8 dims
  uint4 kr[U], vr[U];
  bool ok[U];
  auto issue = [&](int base) {  // a warp's next U passes of keys: their slots, then K and V rows
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int tok = base + u * TPP + sub;
      ok[u] = tok < t1;
      kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
      if (ok[u]) {
        const int64_t slot = table[tok];
        const size_t off = (size_t)(slot * p.kv_heads + j) * D + dl;
        kr[u] = __ldcg(reinterpret_cast<const uint4*>(L.k_cache + off));
        vr[u] = __ldcg(reinterpret_cast<const uint4*>(L.v_cache + off));
      }
    }
  };
  // the cached keys are earlier steps' (the new token's slot is never among them): read before q is ready
  int base = t0 + warp * TPP * U;
  issue(base);
  wait_count(p, p.counters + (size_t)layer * kCountStride + kQkv, (epoch + 1u) * gridDim.x);
  stamp(p, layer, 3);
  hold(sm, 0u);
  const int64_t pos = p.positions[0];
  const float* cs = p.cos_sin + pos * D;

  // q heads j*G .. j*G+G-1, then k head j, by warps 0..G; v by warp G+1
  if (warp <= G) {
    float* dst = warp < G ? qs + warp * D : kn;
    const float* src = warp < G ? p.qkv + (j * G + warp) * D : p.qkv + q_size + j * D;
    float v[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) v[e] = __ldcg(src + lane + 32 * e);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = v[e];
    __syncwarp();
    norm_rope<D>(dst, warp < G ? L.q_norm : L.k_norm, p.qk_eps, cs, lane);
    if (warp == G) {  // the cache holds bf16: use the rounded key for the new token too
      for (int i = lane; i < D; i += 32) kn[i] = bf(__float2bfloat16(kn[i]));
    } else {
      for (int i = lane; i < D; i += 32) dst[i] *= p.scale_log2;
    }
  } else if (warp == G + 1) {
    float v[D / 32];
#pragma unroll
    for (int e = 0; e < D / 32; ++e) v[e] = __ldcg(p.qkv + q_size + kv_size + j * D + lane + 32 * e);
#pragma unroll
    for (int e = 0; e < D / 32; ++e) vn[lane + 32 * e] = bf(__float2bfloat16(v[e]));
  }
  consumer_sync();
  if (s == 0) {  // the new token's K/V into the cache, once a head
    const int64_t slot = p.out_loc[0];
    for (int i = tid; i < D; i += kConsumers) {
      L.k_cache[(slot * p.kv_heads + j) * D + i] = __float2bfloat16(kn[i]);
      L.v_cache[(slot * p.kv_heads + j) * D + i] = __float2bfloat16(vn[i]);
    }
  }

  float q[G][8], acc[G][8], m[G], l[G];
#pragma unroll
  for (int gi = 0; gi < G; ++gi) {
    m[gi] = -INFINITY;
    l[gi] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q[gi][e] = qs[gi * D + dl + e];
      acc[gi][e] = 0.f;
    }
  }
  // one key a lane group (valid is uniform over the group; every lane of the warp takes part in the shuffles)
  auto take = [&](const float (&k)[8], const float (&v)[8], bool valid) {
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < 8; ++e) sc += q[gi][e] * k[e];
#pragma unroll
      for (int o = LPT / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o, LPT);
      if (valid) {
        const float mn = fmaxf(m[gi], sc);
        const float corr = exp2f(m[gi] - mn), pr = exp2f(sc - mn);
        l[gi] = l[gi] * corr + pr;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[gi][e] = acc[gi][e] * corr + pr * v[e];
        m[gi] = mn;
      }
    }
  };

  for (; base < t1; base += kWarps * TPP * U) {
    if (base != t0 + warp * TPP * U) issue(base);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float k[8], v[8];
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kr[u]);
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vr[u]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float2 a = __bfloat1622float2(k2[e]), c = __bfloat1622float2(v2[e]);
        k[2 * e] = a.x;
        k[2 * e + 1] = a.y;
        v[2 * e] = c.x;
        v[2 * e + 1] = c.y;
      }
      take(k, v, ok[u]);
    }
  }
  if (s == used - 1 && warp == 0) {  // the new token, in the last split, by the warp's first key group
    float k[8], v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      k[e] = kn[dl + e];
      v[e] = vn[dl + e];
    }
    take(k, v, sub == 0);
  }
  // the warp's keys groups merged (lanes with the same dims), then each warp's state to smem
#pragma unroll
  for (int o = LPT; o < 32; o <<= 1) {
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[gi], o), lo = __shfl_xor_sync(0xffffffffu, l[gi], o);
      const float mn = fmaxf(m[gi], mo);
      const float a = mn == -INFINITY ? 0.f : exp2f(m[gi] - mn), c = mn == -INFINITY ? 0.f : exp2f(mo - mn);
      l[gi] = l[gi] * a + lo * c;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[gi][e] = acc[gi][e] * a + __shfl_xor_sync(0xffffffffu, acc[gi][e], o) * c;
      m[gi] = mn;
    }
  }
  consumer_sync();  // qs / kn / vn read by everyone before ws (after them) is written
  if (sub == 0) {
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
      float* w = ws + (warp * G + gi) * (D + 2);
#pragma unroll
      for (int e = 0; e < 8; ++e) w[dl + e] = acc[gi][e];
      if (lane == 0) {
        w[D] = m[gi];
        w[D + 1] = l[gi];
      }
    }
  }
  consumer_sync();
  float* part = p.part + ((size_t)j * p.splits + s) * G * (D + 2);
  for (int i = tid; i < G * D; i += kConsumers) {
    const int gi = i / D, d = i % D;
    float mx = -INFINITY;
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ws[(w * G + gi) * (D + 2) + D]);
    float a = 0.f, sum = 0.f;
    if (mx != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float* st = ws + (w * G + gi) * (D + 2);
        const float f = exp2f(st[D] - mx);
        a += st[d] * f;
        sum += st[D + 1] * f;
      }
    }
    part[gi * (D + 2) + d] = a;
    if (d == 0) {
      part[gi * (D + 2) + D] = mx;
      part[gi * (D + 2) + D + 1] = sum;
    }
  }
}

template <int D, int G>
__device__ void attend_item(const Params& p, const Layer& L, Smem& sm, int layer, int item, unsigned epoch) {
  const int tid = threadIdx.x, S = p.splits, j = item / S, s = item % S;
  const int cached = (int)p.seq_lens[0] - 1;  // keys already in the cache; the new token's come from qkv
  const int used = max(1, min(S, (cached + kMinSplitTokens - 1) / kMinSplitTokens));  // splits with keys
  if (s < used) attend_split<D, G>(p, L, sm, layer, j, s, used, cached, epoch);
  stamp(p, layer, 4);
  // the head's last split to finish (with keys or not) merges the head's splits into attn
  consumer_sync();
  if (tid == 0) {  // acq_rel: publishes this split's part, and the last one sees every other split's
    unsigned* head = p.counters + (size_t)layer * kCountStride + kHead + j;
    const unsigned old = add_acq_rel(head, 1u);
    sm.misc[kWarps] = old == (epoch + 1u) * (unsigned)S - 1u ? 1.f : 0.f;
  }
  consumer_sync();
  if (sm.misc[kWarps] == 0.f) {
    stamp(p, layer, 5);
    return;
  }
  const float* parts = p.part + (size_t)j * S * G * (D + 2);
  for (int i = tid; i < G * D; i += kConsumers) {
    const int gi = i / D, d = i % D;
    float mx = -INFINITY, a = 0.f, sum = 0.f;
#pragma unroll 4
    for (int s2 = 0; s2 < used; ++s2) {
      const float* st = parts + (s2 * G + gi) * (D + 2);
      const float ms = __ldcg(st + D), as = __ldcg(st + d), ls = __ldcg(st + D + 1);
      if (ms == -INFINITY) continue;
      const float mn = fmaxf(mx, ms), f0 = exp2f(mx - mn), f1 = exp2f(ms - mn);
      a = a * f0 + as * f1;
      sum = sum * f0 + ls * f1;
      mx = mn;
    }
    p.attn[(j * G + gi) * D + d] = a / sum;
  }
  signal_count(p.counters + (size_t)layer * kCountStride + kAttn);
  stamp(p, layer, 5);
}
template <int D, int G>
__device__ void attend_all(const Params& p, const Layer& L, Smem& sm, int layer, unsigned epoch) {
  for (int item = blockIdx.x; item < p.kv_heads * p.splits; item += gridDim.x) {
    attend_item<D, G>(p, L, sm, layer, item, epoch);
    consumer_sync();
  }
}

// Returns the launch's epoch (launches of this kernel before it on these counters).
template <int D, int G>
__device__ __forceinline__ unsigned consume(const Params& p, Smem& sm) {
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the step's inputs are written by the kernels before
  if (threadIdx.x == 0)
    sm.misc[kWarps + 1] = __uint_as_float(__ldcg(p.counters + (size_t)p.num_layers * kCountStride + 1));
  consumer_sync();
  const unsigned epoch = __float_as_uint(sm.misc[kWarps + 1]), next = epoch + 1u;
  RingPos pos;
  for (int layer = 0; layer < p.num_layers; ++layer) {
    const Layer L = p.layers[layer];
    unsigned* c = p.counters + (size_t)layer * kCountStride;
    float scale = 1.f;  // the input's RMSNorm scale (QKV, gate and up), or 1
    // One pass of this loop a GEMV (QKV, O, gate, up), so the GEMV's code is in the kernel once: its inlined copies
    // were half the kernel's SASS, which every layer runs through (docs/gpu-notes.md, fifty-fifth session).
#pragma unroll 1
    for (int op = kOpQkv; op <= kOpUp; ++op) {
      if (op != kOpUp) {  // the dependency, then the input staged (up's is gate's)
        if (op == kOpQkv && layer > 0) wait_count(p, c - kCountStride + kDown, next * gridDim.x);
        if (op == kOpO) wait_count(p, c + kAttn, next * (unsigned)p.kv_heads);
        if (op == kOpGate) wait_count(p, c + kO, next * gridDim.x);
        stamp(p, layer, op == kOpQkv ? 0 : op == kOpO ? 6 : 9);
        if (op == kOpQkv) {
          scale = layer == 0 ? load_normed(sm, p.x_in, p.hidden, p.eps)
                             : norm_scale(sm, stage_h(p, sm), p.hidden, p.eps);
        } else if (op == kOpGate) {
          scale = load_normed(sm, p.h_mid, p.hidden, p.eps);
        } else {
          scale = 1.f;
          load_plain(p, sm, p.attn, p.heads * p.head_dim, layer == 0);
        }
        hold(sm, 0u);
      }
      gemv(p, L, sm, op, layer, pos, op == kOpQkv ? 1 : op == kOpO ? 7 : op == kOpGate ? 10 : -1, scale);
      if (op == kOpGate) continue;
      stamp(p, layer, op == kOpQkv ? 2 : op == kOpO ? 8 : 11);
      if (op == kOpUp) break;  // DOWN follows on the block's own act: nothing to count or wait for
      hold(sm, 1u);
      signal_count(c + (op == kOpQkv ? kQkv : kO));
      if (op == kOpQkv) {
        if ((int)blockIdx.x < p.kv_heads * p.splits) attend_all<D, G>(p, L, sm, layer, epoch);
        hold(sm, 0u);  // a block with no keys to attend to lets its producer go on at once
      }
    }
    stamp(p, layer, 12);
    down_split_k(p, sm, layer, pos);
    stamp(p, layer, 14);
    if (layer + 1 < p.num_layers) hold(sm, 1u);
    signal_count(c + kDown);
  }
  // every block's DOWN partials are in h once the last layer's DOWN is counted: the block's rows of x_out
  wait_count(p, p.counters + (size_t)(p.num_layers - 1) * kCountStride + kDown, next * gridDim.x);
  const Seg o = sm.segs[kOpO];
  for (int i = threadIdx.x; i < o.rows; i += kConsumers)
    p.x_out[o.row0 + i] = __float2bfloat16(h_at(p, o.row0 + i));
  return epoch;
}

// One kernel a (head dim D, query heads a KV head G): a launch carries only its own attention code.
template <int D, int G>
__global__ void __launch_bounds__(kThreads, 1) decode_bs1_kernel(const Params p, int xs_floats) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ Seg segs[5];
  __shared__ unsigned hold_s;
  Smem sm;
  sm.segs = segs;
  sm.hold = &hold_s;
  sm.ring = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  sm.full = reinterpret_cast<uint64_t*>(smem_raw + (size_t)p.slots * kSlotBytes);
  sm.empty = sm.full + kMaxSlots;
  sm.xs = reinterpret_cast<float*>(sm.empty + kMaxSlots);
  sm.part = sm.xs + xs_floats;
  sm.rows = sm.part + kPartMax;
  sm.misc = sm.rows + kGateMax;
  __shared__ unsigned epoch_s;
  unsigned* exits = p.counters + (size_t)p.num_layers * kCountStride;
  unsigned* epoch_p = exits + 1;
  if (threadIdx.x == 0) {
    for (int i = 0; i < p.slots; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], kWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    block_segments(p, blockIdx.x, gridDim.x, segs);
    hold_s = 0u;
  }
  __syncthreads();
  if (threadIdx.x >= kConsumers) {
    if (threadIdx.x == kConsumers) produce(p, sm);
  } else {
    const unsigned e = consume<D, G>(p, sm);
    if (threadIdx.x == 0) epoch_s = e;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned epoch = epoch_s;
    __threadfence();
    const unsigned old = add_acq_rel(exits, 1u);
    if (old == (epoch + 1u) * gridDim.x - 1u) {  // every block is past every wait: the next launch's epoch
      __threadfence();
      atomicExch(epoch_p, epoch + 1u);
    }
  }
}

// The launch's shape: grid, dynamic shared memory, stream, PDL.
struct Launch {
  int grid, smem;
  void* stream;
  bool pdl;
};

template <int D, int G>
cudaError_t launch(const Launch& l, const Params& p, int xs_floats) {
  return launch_ring_kernel(decode_bs1_kernel<D, G>, l.grid, l.smem, l.stream, l.pdl, p, xs_floats);
}

template <int D>
cudaError_t launch_for_group(const Launch& l, const Params& p, int xs_floats) {
  switch (p.heads / p.kv_heads) {
    case 1:
      return launch<D, 1>(l, p, xs_floats);
    case 2:
      return launch<D, 2>(l, p, xs_floats);
    case 3:
      return launch<D, 3>(l, p, xs_floats);
    case 4:
      return launch<D, 4>(l, p, xs_floats);
    default:
      return cudaErrorInvalidValue;  // weights.unsupported_reason refuses it first
  }
}

}  // namespace

extern "C" {

// Shared-memory bytes a block uses for `slots` ring slots and an input vector of xs_floats.
int ost_decode_bs1_smem_bytes(int slots, int xs_floats) {
  return slots * kSlotBytes + 2 * kMaxSlots * 8 + (xs_floats + kPartMax + kGateMax + kWarps + 4) * 4;
}

int ost_decode_bs1_max_slots() { return kMaxSlots; }
int ost_decode_bs1_max_h_copies() { return kMaxHCopies; }
int ost_decode_bs1_slot_bytes() { return kSlotBytes; }
int ost_decode_bs1_trace_slots() { return kTraceSlots; }
int ost_decode_bs1_rows_max() { return kGateMax; }
int ost_decode_bs1_part_max() { return kPartMax; }
int ost_decode_bs1_count_stride() { return kCountStride; }

// Launches the step on `stream` (graph capture records it); returns a cudaError_t.
int ost_decode_bs1_launch(const void* layers, int num_layers, int hidden, int heads, int kv_heads, int head_dim,
                          int inter, int splits, int slots, int h_copies, int grid, int xs_floats, float eps,
                          float qk_eps, float scale_log2, const void* x_in, void* x_out, const void* positions,
                          const void* seq_lens, const void* req_rows, const void* out_loc, const void* req_to_token,
                          long long table_stride, const void* cos_sin, void* h, void* qkv, void* attn, void* h_mid,
                          void* part, void* counters, void* trace, int flags, int pdl, void* stream) {
  Params p;
  p.layers = static_cast<const Layer*>(layers);
  p.num_layers = num_layers;
  p.hidden = hidden;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = head_dim;
  p.inter = inter;
  p.splits = splits;
  p.slots = slots;
  p.h_copies = h_copies;
  p.eps = eps;
  p.qk_eps = qk_eps;
  p.scale_log2 = scale_log2;
  p.x_in = static_cast<const __nv_bfloat16*>(x_in);
  p.x_out = static_cast<__nv_bfloat16*>(x_out);
  p.positions = static_cast<const int64_t*>(positions);
  p.seq_lens = static_cast<const int64_t*>(seq_lens);
  p.req_rows = static_cast<const int64_t*>(req_rows);
  p.out_loc = static_cast<const int64_t*>(out_loc);
  p.req_to_token = static_cast<const int32_t*>(req_to_token);
  p.table_stride = table_stride;
  p.cos_sin = static_cast<const float*>(cos_sin);
  p.h = static_cast<float*>(h);
  p.qkv = static_cast<float*>(qkv);
  p.attn = static_cast<float*>(attn);
  p.h_mid = static_cast<float*>(h_mid);
  p.part = static_cast<float*>(part);
  p.counters = static_cast<unsigned*>(counters);
  p.trace = static_cast<unsigned long long*>(trace);
  p.flags = flags;
  const Launch l = {grid, ost_decode_bs1_smem_bytes(slots, xs_floats), stream, pdl != 0};
  switch (head_dim) {
    case 64:
      return (int)launch_for_group<64>(l, p, xs_floats);
    case 128:
      return (int)launch_for_group<128>(l, p, xs_floats);
    default:
      return (int)cudaErrorInvalidValue;
  }
}

const char* ost_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }

}  // extern "C"
