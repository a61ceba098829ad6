// What one GEMV-to-GEMV hand-off costs on the GPU, by the form of the hand-off: the question a decode megakernel
// turns on (#16's bs-1 rows, docs/gpu-notes.md). A chain of N square GEMVs y = W_p x (bf16 weights, fp32
// activations staged in each block's shared memory, distinct weights per step, so they stream from HBM) runs four
// ways:
//   launch      one kernel a GEMV, captured in a CUDA graph (each waits for the last to complete);
//   pdl         the same with Programmatic Dependent Launch: a kernel loads its weight rows into registers, then
//               waits for the previous grid (griddepcontrol.wait) and lets the next one in (the engine's
//               resident GEMV, layers/triton_ops/resident_gemv.py);
//   flag        one persistent kernel, a block an SM, that runs every GEMV: a block waits for the previous GEMV's
//               count to reach the grid (a gpu-scope acquire load), computes its rows, then adds one to this
//               GEMV's count (a release);
//   flag_ahead  the same, each block loading its next weight rows into registers before it waits.
// Each reports us a GEMV, against the weights' bytes at the copy rate it measures; the four final vectors must
// agree (the same sums in the same order), which the program checks.
//
// nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -o /tmp/hop_latency benchmarks/hop_latency.cu
// /tmp/hop_latency [dim=1024] [gemvs=112] [reps=20] [same=0]  # Qwen3-0.6B-sized: 1024 x 1024, 28 layers x 4
// (same=1: every GEMV reads the first W, which stays in L2, so what is left is the hand-off and the body's latency)
#include <cuda/atomic>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e = (x);                                                                          \
    if (e != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));      \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

constexpr int kWarps = 8;             // a block: 8 warps, one output row a warp at a time
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxChunks = 8;         // 16-byte weight chunks a lane holds for a row: dim <= 8 * 8 * 32 = 2048

// A warp's row of W (dim bf16) as 16-byte chunks, lane-strided: chunk c of lane l is elements (c * 32 + l) * 8 ..
struct RowChunks {
  uint4 w[kMaxChunks];
};

__device__ __forceinline__ RowChunks load_row(const __nv_bfloat16* __restrict__ row, int dim, int lane) {
  RowChunks r;
  const uint4* p = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    int chunk = c * 32 + lane;
    r.w[c] = chunk * 8 < dim ? __ldg(p + chunk) : make_uint4(0, 0, 0, 0);
  }
  return r;
}

// x (fp32, dim floats, in L2: the last GEMV's output) into the block's shared memory, one read a block (a read a
// warp would make every SM's warps queue on the same few L2 lines).
__device__ __forceinline__ void stage_x(const float* x, float* xs, int dim) {
  for (int i = threadIdx.x * 4; i < dim; i += kThreads * 4)
    *reinterpret_cast<float4*>(xs + i) = __ldcg(reinterpret_cast<const float4*>(x + i));
  __syncthreads();
}

// The row's dot with x (staged in shared memory), summed in a fixed order: lanes' chunks, then a butterfly over
// the warp.
__device__ __forceinline__ float row_dot(const RowChunks& r, const float* xs, int dim, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < kMaxChunks; ++c) {
    int base = (c * 32 + lane) * 8;
    if (base < dim) {
      const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(&r.w[c]);
      float4 x0 = *reinterpret_cast<const float4*>(xs + base);
      float4 x1 = *reinterpret_cast<const float4*>(xs + base + 4);
      acc += __bfloat162float(w[0]) * x0.x + __bfloat162float(w[1]) * x0.y + __bfloat162float(w[2]) * x0.z +
             __bfloat162float(w[3]) * x0.w + __bfloat162float(w[4]) * x1.x + __bfloat162float(w[5]) * x1.y +
             __bfloat162float(w[6]) * x1.z + __bfloat162float(w[7]) * x1.w;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  return acc;
}

// Rows of block b: b, b + grid, b + 2 grid, ... ; warp w takes every kWarps-th of those. A block's rows this way are
// spread over the matrix, as a GEMV's row tiles are over its programs.
__device__ __forceinline__ int rows_per_warp(int dim, int grid) {
  return (dim + grid * kWarps - 1) / (grid * kWarps);
}

constexpr int kHeld = 2;  // rows a warp holds in registers across a wait (the register budget)

// y's rows of this warp: the held ones first, then the rest loaded as they go.
__device__ __forceinline__ void store_rows(const RowChunks (&held)[kHeld], const __nv_bfloat16* __restrict__ w,
                                           const float* xs, float* y, int dim, int per, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    int row = (i * kWarps + warp) * gridDim.x + blockIdx.x;
    if (i < per && row < dim) {
      float v = row_dot(held[i], xs, dim, lane);
      if (lane == 0) y[row] = v;
    }
  }
  for (int i = kHeld; i < per; ++i) {
    int row = (i * kWarps + warp) * gridDim.x + blockIdx.x;
    if (row >= dim) break;
    float v = row_dot(load_row(w + (size_t)row * dim, dim, lane), xs, dim, lane);
    if (lane == 0) y[row] = v;
  }
}

// One GEMV as a kernel (launch / pdl). PDL: the weight rows are read before the wait (they are no kernel's output).
template <bool PDL>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const __nv_bfloat16* __restrict__ w, const float* x,
                                                        float* y, int dim) {
  __shared__ __align__(16) float xs[kMaxChunks * 8 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = rows_per_warp(dim, gridDim.x);
  // a warp's first kHeld rows are held in registers across the wait (unrolled: static indices)
  RowChunks held[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    int row = (i * kWarps + warp) * gridDim.x + blockIdx.x;
    if (i < per && row < dim) held[i] = load_row(w + (size_t)row * dim, dim, lane);
  }
  if (PDL) {
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
  }
  stage_x(x, xs, dim);
  store_rows(held, w, xs, y, dim, per, warp, lane);
}

// Every GEMV in one kernel; counts[p] reaches gridDim.x * (rep + 1) once GEMV p of repetition rep is stored.
template <bool AHEAD>
__global__ void __launch_bounds__(kThreads) chain_kernel(const __nv_bfloat16* __restrict__ w, float* buf0,
                                                         float* buf1, unsigned* counts, int dim, int gemvs,
                                                         size_t w_stride, unsigned rep, unsigned* stuck) {
  __shared__ __align__(16) float xs[kMaxChunks * 8 * 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per = rows_per_warp(dim, gridDim.x);
  const unsigned goal = gridDim.x * (rep + 1);
  RowChunks held[kHeld];
  for (int p = 0; p < gemvs; ++p) {
    const __nv_bfloat16* wp = w + p * w_stride;
    const float* x = (p & 1) ? buf1 : buf0;
    float* y = (p & 1) ? buf0 : buf1;
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {  // before the wait (AHEAD) or after it
      int row = (i * kWarps + warp) * gridDim.x + blockIdx.x;
      if (AHEAD && i < per && row < dim) held[i] = load_row(wp + (size_t)row * dim, dim, lane);
    }
    if (p > 0) {
      if (threadIdx.x == 0) {
        cuda::atomic_ref<unsigned, cuda::thread_scope_device> c(counts[p - 1]);
        // bounded: were a block never resident (the grid larger than the GPU holds) the others would spin forever
        for (unsigned spins = 0; c.load(cuda::memory_order_acquire) < goal; ++spins) {
          if (spins == (1u << 26)) {
            atomicAdd(stuck, 1u);
            break;
          }
        }
      }
      __syncthreads();
    }
    if (!AHEAD) {
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        int row = (i * kWarps + warp) * gridDim.x + blockIdx.x;
        if (i < per && row < dim) held[i] = load_row(wp + (size_t)row * dim, dim, lane);
      }
    }
    stage_x(x, xs, dim);
    store_rows(held, wp, xs, y, dim, per, warp, lane);
    __syncthreads();  // the block's rows stored (and xs read) before its count goes up
    if (threadIdx.x == 0) {
      cuda::atomic_ref<unsigned, cuda::thread_scope_device> c(counts[p]);
      c.fetch_add(1u, cuda::memory_order_release);
    }
  }
}

__global__ void init_weights(__nv_bfloat16* w, size_t n, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ (unsigned)(i >> 32);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    w[i] = __float2bfloat16(((h & 0xFFFF) / 32768.f - 1.f) * scale);
  }
}

static float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

int main(int argc, char** argv) {
  const int dim = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int gemvs = argc > 2 ? std::atoi(argv[2]) : 112;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 20;
  const bool same = argc > 4 && std::atoi(argv[4]) != 0;  // every GEMV reads one W (in L2): the hand-off alone
  const size_t w_stride = same ? 0 : (size_t)dim * dim;
  constexpr int kWarmups = 5;
  if (dim % 8 || dim > kMaxChunks * 8 * 32 || gemvs < 2 || gemvs % 2) {
    std::fprintf(stderr, "dim: a multiple of 8 up to %d; gemvs: even, >= 2\n", kMaxChunks * 8 * 32);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int grid = prop.multiProcessorCount;  // one block an SM: the persistent kernel's blocks are all resident
  const size_t wn = (size_t)gemvs * dim * dim;
  __nv_bfloat16* w;
  float *x0, *buf0, *buf1;
  unsigned *counts, *stuck;
  CHECK(cudaMalloc(&w, wn * sizeof(__nv_bfloat16)));
  CHECK(cudaMalloc(&x0, dim * sizeof(float)));
  CHECK(cudaMalloc(&buf0, dim * sizeof(float)));
  CHECK(cudaMalloc(&buf1, dim * sizeof(float)));
  CHECK(cudaMalloc(&counts, gemvs * sizeof(unsigned)));
  CHECK(cudaMalloc(&stuck, sizeof(unsigned)));
  CHECK(cudaMemset(stuck, 0, sizeof(unsigned)));
  init_weights<<<1024, 256>>>(w, wn, 1.7f / std::sqrt((float)dim));
  std::vector<float> hx(dim);
  for (int i = 0; i < dim; ++i) hx[i] = std::sin(0.37f * i) + 0.5f;
  CHECK(cudaMemcpy(x0, hx.data(), dim * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));

  // the copy rate (bytes read + written a second), ten back-to-back copies of the weights' buffer
  void* scratch;
  CHECK(cudaMalloc(&scratch, wn * sizeof(__nv_bfloat16)));
  CHECK(cudaMemcpyAsync(scratch, w, wn * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, s));
  CHECK(cudaEventRecord(e0, s));
  for (int i = 0; i < 10; ++i)
    CHECK(cudaMemcpyAsync(scratch, w, wn * sizeof(__nv_bfloat16), cudaMemcpyDeviceToDevice, s));
  CHECK(cudaEventRecord(e1, s));
  CHECK(cudaStreamSynchronize(s));
  const double copy_bps = 10.0 * 2 * wn * sizeof(__nv_bfloat16) / (elapsed_ms(e0, e1) * 1e-3);
  CHECK(cudaFree(scratch));
  const double floor_us = (double)dim * dim * sizeof(__nv_bfloat16) / copy_bps * 1e6;

  std::vector<std::vector<float>> finals;
  auto report = [&](const char* name, double ms_per_chain) {
    double us = ms_per_chain * 1e3 / gemvs;
    std::printf("%-10s dim %5d gemvs %4d%s: %7.3f us a GEMV (weights at the copy rate %.3f us, %.2f TB/s)\n", name,
                dim, gemvs, same ? " one W" : "", us, floor_us, (double)dim * dim * 2 / (us * 1e-6) / 1e12);
    std::vector<float> out(dim);
    CHECK(cudaMemcpy(out.data(), buf0, dim * sizeof(float), cudaMemcpyDeviceToHost));  // gemvs even: buf0
    finals.push_back(out);
  };

  // launch / pdl: the chain captured in a graph; x0 copied into buf0 first
  for (int pdl = 0; pdl < 2; ++pdl) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemcpyAsync(buf0, x0, dim * sizeof(float), cudaMemcpyDeviceToDevice, s));
    for (int p = 0; p < gemvs; ++p) {
      const float* x = (p & 1) ? buf1 : buf0;
      float* y = (p & 1) ? buf0 : buf1;
      const __nv_bfloat16* wp = w + p * w_stride;
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(grid);
      cfg.blockDim = dim3(kThreads);
      cfg.stream = s;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      cfg.attrs = attr;
      cfg.numAttrs = (pdl && p > 0) ? 1 : 0;
      if (pdl)
        CHECK(cudaLaunchKernelEx(&cfg, gemv_kernel<true>, wp, x, y, dim));
      else
        CHECK(cudaLaunchKernelEx(&cfg, gemv_kernel<false>, wp, x, y, dim));
    }
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int r = 0; r < kWarmups; ++r) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e0, s));
    for (int r = 0; r < reps; ++r) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaStreamSynchronize(s));
    report(pdl ? "pdl" : "launch", elapsed_ms(e0, e1) / reps);
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
  }

  // flag / flag_ahead: one launch a chain; counts zeroed once, then compared against the repetition's goal
  for (int ahead = 0; ahead < 2; ++ahead) {
    CHECK(cudaMemsetAsync(counts, 0, gemvs * sizeof(unsigned), s));
    auto run = [&](unsigned rep) {
      CHECK(cudaMemcpyAsync(buf0, x0, dim * sizeof(float), cudaMemcpyDeviceToDevice, s));
      if (ahead)
        chain_kernel<true><<<grid, kThreads, 0, s>>>(w, buf0, buf1, counts, dim, gemvs, w_stride, rep, stuck);
      else
        chain_kernel<false><<<grid, kThreads, 0, s>>>(w, buf0, buf1, counts, dim, gemvs, w_stride, rep, stuck);
      CHECK(cudaGetLastError());
    };
    for (int r = 0; r < kWarmups; ++r) run(r);
    CHECK(cudaEventRecord(e0, s));
    for (int r = kWarmups; r < kWarmups + reps; ++r) run(r);
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaStreamSynchronize(s));
    report(ahead ? "flag_ahead" : "flag", elapsed_ms(e0, e1) / reps);
  }

  unsigned hstuck = 0;
  CHECK(cudaMemcpy(&hstuck, stuck, sizeof(unsigned), cudaMemcpyDeviceToHost));
  if (hstuck) std::printf("the persistent kernel's waits gave up %u times: its figures are void\n", hstuck);
  // the same sums in the same order; a tolerance in case the compiler contracts the kernels' FMAs differently
  int bad = 0;
  for (size_t v = 1; v < finals.size(); ++v)
    for (int i = 0; i < dim; ++i)
      if (std::fabs(finals[v][i] - finals[0][i]) > 1e-4f * (1.f + std::fabs(finals[0][i]))) ++bad;
  std::printf("final vectors %s (%d entries differ from launch's)\n", bad ? "DIFFER" : "agree", bad);
  return bad || hstuck ? 1 : 0;
}
