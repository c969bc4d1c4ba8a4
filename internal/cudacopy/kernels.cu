// Copy, fill and checksum kernels for kvoffload's transfer layer.
//
// Compiled to PTX for compute_80 by `make ptx` (nvcc on a GPU machine), with
// the PTX ISA version lowered to the oldest that the code needs, and embedded
// in the Go binary. Host memory is addressed through its registered pointer
// (or the device pointer cuMemHostGetDevicePointer returns).
//
// Descriptor table: an array of Desc in device memory. One warp per
// descriptor, grid-stride over descriptors; the Go side splits long segments
// into chunks so that warps stay balanced. The copy, fill and checksum
// kernels are bounded to 1024 threads per CTA (__launch_bounds__), so they
// launch at any block size up to 1024 without running out of registers.
//
// kvo_sgemm is not part of the transfer path: it is the compute-bound
// matrix product the throughput benchmark runs beside the transfers.
#include <stdint.h>

// A copy descriptor with aux == 0 copies len contiguous bytes. With
// aux != 0 it is a 2-D copy (see copy_rows): rows (aux bits 48-63) rows of
// len bytes, row r from src + r * source pitch to dst + r * destination
// pitch, the pitches in units of 16 bytes in aux bits 24-47 (source) and
// 0-23 (destination). The Go side sends 2-D descriptors only to an image
// that has kvo_desc2d (older images ignore aux in copies).
struct Desc {
    uint64_t src;
    uint64_t dst;
    uint64_t len;
    uint64_t aux; // fill: the segment's seed; copies: 0, or the 2-D shape
};

#define UNROLL 8

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// load16/store16 move one 16-byte word. Streaming = true uses the global
// state space with evict-first hints (ld.global.cs / st.global.cs), so the
// copy neither goes through generic addressing nor pushes other kernels'
// data out of L2; false leaves the choice to the compiler (generic ld/st).
template <bool Streaming>
__device__ __forceinline__ uint4 load16(const uint4* p) {
    if (Streaming) return __ldcs(p);
    return *p;
}
template <bool Streaming>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
    if (Streaming) {
        __stcs(p, v);
    } else {
        *p = v;
    }
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Throttle is one warp's state in kvo_copy_sys: fence_iters and pace_ns are
// the kernel's arguments, iters the loop iterations since the last fence,
// next the earliest time (globaltimer ns) the next iteration may start.
struct Throttle {
    uint64_t fence_iters;
    uint64_t pace_ns;
    uint64_t iters;
    uint64_t next;
    uint32_t probe;  // Probe: the read-back in flight
    bool pending;    // Probe: a read-back was issued
};

// throttle runs after each loop iteration of a warp (4 KiB): every
// fence_iters iterations, a system-scope fence (__threadfence_system),
// which returns once the warp's earlier stores are visible to the host and
// so bounds the stores it has in flight, or with Probe a read-back of a
// word the lane just stored (see kvo_copy_probe); then, with pace_ns, a
// wait until pace_ns after the previous iteration's start, keeping at most
// one iteration of credit when the warp fell behind, so the grid's rate
// stays at or below the configured one instead of outrunning the link.
template <bool Probe>
__device__ __forceinline__ void throttle(Throttle* th, const uint4* last) {
    if (th->fence_iters != 0 && ++th->iters >= th->fence_iters) {
        if (Probe) {
            // Wait for the previous read-back, then read back a word this
            // lane just stored (a volatile load goes to memory): each
            // read's round trip stands in for a fence, and the warp has at
            // most two intervals of stores ahead of the last read that
            // returned. The branch on the value is the wait (a load whose
            // value nothing uses stalls the warp only when its register is
            // next written, wherever the compiler put that); the key is a
            // kernel argument the compiler cannot know, and a stored word
            // equal to it costs a 32 ns sleep.
            if (th->pending && th->probe == ((uint32_t)(th->fence_iters >> 32) ^ 0x9E3779B9u)) __nanosleep(32);
            th->probe = *(volatile const uint32_t*)last;
            th->pending = true;
        } else {
            __threadfence_system();
        }
        th->iters = 0;
    }
    if (th->pace_ns != 0) {
        th->next += th->pace_ns;
        uint64_t now = global_ns();
        if (now > th->next + th->pace_ns) th->next = now - th->pace_ns;
        while (now < th->next) {
            __nanosleep(256);
            now = global_ns();
        }
        __syncwarp();
    }
}

// copy_segment copies one descriptor's bytes with one warp; with Throttled,
// throttle runs after every loop iteration (see kvo_copy_sys).
template <bool Streaming, bool Throttled, bool Probe = false>
__device__ __forceinline__ void copy_segment(const char* src, char* dst, uint64_t len, unsigned lane, Throttle* th) {
    if ((((uintptr_t)src | (uintptr_t)dst | len) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        uint64_t n = len >> 4;
        uint64_t i = lane;
        // Each lane keeps UNROLL independent 16-byte loads in flight before
        // its stores: 4 KiB per warp per iteration.
        for (; i + 32 * (UNROLL - 1) < n; i += 32 * UNROLL) {
            uint4 r[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) r[k] = load16<Streaming>(s + i + 32 * k);
#pragma unroll
            for (int k = 0; k < UNROLL; k++) store16<Streaming>(d + i + 32 * k, r[k]);
            if (Throttled) throttle<Probe>(th, d + i);
        }
        for (; i < n; i += 32) store16<Streaming>(d + i, load16<Streaming>(s + i));
    } else {
        for (uint64_t i = lane; i < len; i += 32) dst[i] = src[i];
    }
}

// copy_rows copies one 2-D descriptor with one warp: the 16-byte words of
// its rows, numbered row by row, are spread over the lanes as copy_segment
// spreads one segment's (UNROLL loads in flight per lane, 4 KiB per warp
// per iteration, throttle after each iteration). The Go side bounds a
// descriptor to a chunk of rows, so the word count fits 32 bits.
template <bool Streaming, bool Throttled, bool Probe = false>
__device__ __forceinline__ void copy_rows(const char* src, char* dst, uint64_t row, uint64_t aux, unsigned lane, Throttle* th) {
    const uint32_t rows = (uint32_t)(aux >> 48);
    const uint64_t sp = ((aux >> 24) & 0xFFFFFFull) << 4;
    const uint64_t dp = (aux & 0xFFFFFFull) << 4;
    if ((((uintptr_t)src | (uintptr_t)dst | row) & 15) == 0) {
        const uint32_t w = (uint32_t)(row >> 4);
        const uint32_t n = w * rows;
        uint32_t i = lane;
        for (; i + 32 * (UNROLL - 1) < n; i += 32 * UNROLL) {
            uint4 r[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                uint32_t j = i + 32 * k, q = j / w;
                r[k] = load16<Streaming>((const uint4*)(src + q * sp) + (j - q * w));
            }
            uint4* first = 0;
#pragma unroll
            for (int k = 0; k < UNROLL; k++) {
                uint32_t j = i + 32 * k, q = j / w;
                uint4* p = (uint4*)(dst + q * dp) + (j - q * w);
                if (k == 0) first = p;
                store16<Streaming>(p, r[k]);
            }
            if (Throttled) throttle<Probe>(th, first);
        }
        for (; i < n; i += 32) {
            uint32_t q = i / w;
            store16<Streaming>((uint4*)(dst + q * dp) + (i - q * w), load16<Streaming>((const uint4*)(src + q * sp) + (i - q * w)));
        }
    } else {
        for (uint32_t q = 0; q < rows; q++)
            for (uint64_t b = lane; b < row; b += 32) dst[q * dp + b] = src[q * sp + b];
    }
}

template <bool Streaming, bool Throttled, bool Probe = false>
__device__ __forceinline__ void copy_all(const Desc* descs, uint32_t n, uint64_t fence_iters, uint64_t pace_ns) {
    unsigned lane = threadIdx.x & 31;
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
    Throttle th = {fence_iters, pace_ns, 0, 0, 0, false};
    if (Throttled && pace_ns != 0) th.next = global_ns() - pace_ns;
    for (uint32_t w = warp; w < n; w += nwarps) {
        Desc d = descs[w];
        if (d.aux == 0) {
            copy_segment<Streaming, Throttled, Probe>((const char*)d.src, (char*)d.dst, d.len, lane, &th);
        } else {
            copy_rows<Streaming, Throttled, Probe>((const char*)d.src, (char*)d.dst, d.len, d.aux, lane, &th);
        }
    }
}

// kvo_copy copies every descriptor's src to its dst.
extern "C" __global__ void __launch_bounds__(1024) kvo_copy(const Desc* descs, uint32_t n) {
    copy_all<false, false>(descs, n, 0, 0);
}

// kvo_copy_cs is kvo_copy with global-space, evict-first (streaming) loads
// and stores.
extern "C" __global__ void __launch_bounds__(1024) kvo_copy_cs(const Desc* descs, uint32_t n) {
    copy_all<true, false>(descs, n, 0, 0);
}

// kvo_copy_sys is kvo_copy with each warp throttled (see throttle): a
// system-scope fence after every fence_iters iterations (0: none) and, with
// pace_ns > 0, at most one 4 KiB iteration per pace_ns. Stores to host
// memory are posted: unthrottled, a device-to-host copy keeps as many in
// flight as the GPU's queues hold, and the backlog delays every other SM's
// memory traffic (an n=2048 sgemm ran up to twice as slow beside kvo_copy
// D2H on the H200, bench/results/2026-11-29-h200/kernel_variants.md). The
// fence caps each warp's unfinished host stores at fence_iters * 4 KiB; the
// pace keeps the grid's issue rate under the link's so no backlog forms.
extern "C" __global__ void __launch_bounds__(1024) kvo_copy_sys(const Desc* descs, uint32_t n, uint64_t fence_iters, uint64_t pace_ns) {
    copy_all<false, true>(descs, n, fence_iters, pace_ns);
}

// kvo_copy_probe is kvo_copy_sys with a read-back in place of the fence:
// every fence_iters iterations each lane waits for its previous read-back,
// then loads (volatile, so from host memory) the first word it stored in
// the iteration. A read of host memory cannot pass the posted stores queued ahead of it on
// its way out, so its round trip grows with the backlog and holds the warp
// back while one builds, without the fence's wait for every earlier store
// of the warp to be acknowledged. On the H200, 8 CTAs × 192 threads with a
// read-back every 4 KiB moved 91–93% of the D2H link at 4–64 KiB and slowed
// an sgemm beside it by at most 6.3%; the fence every 4 KiB (kvo_copy_sys,
// 4 × 512) moved 78–85% (bench/results/2026-11-30-h200/probe-sweep-3.md).
extern "C" __global__ void __launch_bounds__(1024) kvo_copy_probe(const Desc* descs, uint32_t n, uint64_t fence_iters, uint64_t pace_ns) {
    copy_all<false, true, true>(descs, n, fence_iters, pace_ns);
}

// A template descriptor (kvo_copy_tmpl): one piece of a block's copy,
// relative to the block. The piece of block id, whose host buffer starts
// at host, lies at dev + id * stride on the device and at host + host_off
// on the host; len and aux are a descriptor's (aux != 0: 2-D, its pitches
// the source's and the destination's of the launch's direction). 64 bytes,
// so the block table that follows a template stays 16-byte aligned.
struct TDesc {
    uint64_t dev;
    uint64_t stride;
    uint64_t host_off;
    uint64_t len;
    uint64_t aux;
    uint64_t pad[3];
};

// A block of a template launch: its host buffer's address (as the kernel
// addresses host memory) and its id on the device.
struct TBlock {
    uint64_t host;
    uint64_t id;
};

// copy_tmpl copies nb blocks of nt template pieces each: the table holds
// the nt TDescs, then the nb TBlocks. Work item w is piece w % nt of
// block w / nt, one warp each, grid-stride, as copy_all. h2d: host to
// device (else device to host). The Go side bounds nt * nb to 32 bits.
template <bool Throttled, bool Probe>
__device__ __forceinline__ void copy_tmpl(const TDesc* t, uint32_t nt, uint32_t nb, uint32_t h2d, uint64_t fence_iters, uint64_t pace_ns) {
    const TBlock* blocks = (const TBlock*)(t + nt);
    unsigned lane = threadIdx.x & 31;
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
    Throttle th = {fence_iters, pace_ns, 0, 0, 0, false};
    if (Throttled && pace_ns != 0) th.next = global_ns() - pace_ns;
    const uint32_t n = nt * nb;
    for (uint32_t w = warp; w < n; w += nwarps) {
        const uint32_t b = w / nt, k = w - b * nt;
        const TDesc d = t[k];
        const TBlock bl = blocks[b];
        const uint64_t host = bl.host + d.host_off, dev = d.dev + bl.id * d.stride;
        const char* src = (const char*)(h2d ? host : dev);
        char* dst = (char*)(h2d ? dev : host);
        if (d.aux == 0) {
            copy_segment<false, Throttled, Probe>(src, dst, d.len, lane, &th);
        } else {
            copy_rows<false, Throttled, Probe>(src, dst, d.len, d.aux, lane, &th);
        }
    }
}

// kvo_copy_tmpl is kvo_copy for a template launch (copy_tmpl): the same
// loop, its descriptors computed from a block's template piece and the
// block, so that a head-sliced copy's table is one entry a block instead
// of one descriptor per head, layer and K/V.
extern "C" __global__ void __launch_bounds__(1024) kvo_copy_tmpl(const TDesc* t, uint32_t nt, uint32_t nb, uint32_t h2d) {
    copy_tmpl<false, false>(t, nt, nb, h2d, 0, 0);
}

// kvo_copy_tmpl_probe is kvo_copy_probe for a template launch.
extern "C" __global__ void __launch_bounds__(1024) kvo_copy_tmpl_probe(const TDesc* t, uint32_t nt, uint32_t nb, uint32_t h2d, uint64_t fence_iters, uint64_t pace_ns) {
    copy_tmpl<true, true>(t, nt, nb, h2d, fence_iters, pace_ns);
}

// kvo_desc2d does nothing: its presence in an image tells the Go side that
// the copy kernels take 2-D descriptors (Desc with aux != 0).
extern "C" __global__ void kvo_desc2d() {}

// kvo_fill writes mix64(aux + i) into 8-byte word i of each descriptor's dst
// (len a multiple of 8), after spinning for spin_cycles clock cycles. The
// delay makes a consumer that does not wait for the fill visibly wrong.
extern "C" __global__ void __launch_bounds__(1024) kvo_fill(const Desc* descs, uint32_t n, uint64_t spin_cycles) {
    if (spin_cycles > 0) {
        long long start = clock64();
        while ((uint64_t)(clock64() - start) < spin_cycles) {
        }
    }
    unsigned lane = threadIdx.x & 31;
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
    for (uint32_t w = warp; w < n; w += nwarps) {
        Desc d = descs[w];
        uint64_t* dst = (uint64_t*)d.dst;
        uint64_t words = d.len >> 3;
        for (uint64_t i = lane; i < words; i += 32) dst[i] = mix64(d.aux + i);
    }
}

// kvo_checksum writes, for each descriptor, the wrapping sum over its 8-byte
// words w[i] of mix64(w[i] ^ (i * 0x9E3779B97F4A7C15)) into out[index]
// (len a multiple of 8). The Go side computes the same function on the host.
extern "C" __global__ void __launch_bounds__(1024) kvo_checksum(const Desc* descs, uint32_t n, uint64_t* out) {
    unsigned lane = threadIdx.x & 31;
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    uint32_t nwarps = (gridDim.x * blockDim.x) >> 5;
    for (uint32_t w = warp; w < n; w += nwarps) {
        Desc d = descs[w];
        const uint64_t* src = (const uint64_t*)d.src;
        uint64_t words = d.len >> 3;
        uint64_t sum = 0;
        for (uint64_t i = lane; i < words; i += 32) sum += mix64(src[i] ^ (i * 0x9E3779B97F4A7C15ull));
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
        if (lane == 0) out[w] = sum;
    }
}

// kvo_sgemm computes C = A * B for row-major n x n float matrices (n a
// multiple of 64) with 64 x 64 tiles per CTA of 256 threads, each thread
// accumulating a 4 x 4 block in registers: a plain, compute-bound matrix
// product that occupies every SM. Grid: (n/64, n/64), block: 256.
#define SG_TILE 64
#define SG_K 16
extern "C" __global__ void __launch_bounds__(256) kvo_sgemm(const float* A, const float* B, float* C, uint32_t n) {
    __shared__ float As[SG_K][SG_TILE];
    __shared__ float Bs[SG_K][SG_TILE];
    const unsigned tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const uint64_t row0 = (uint64_t)blockIdx.y * SG_TILE, col0 = (uint64_t)blockIdx.x * SG_TILE;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (uint32_t k0 = 0; k0 < n; k0 += SG_K) {
#pragma unroll
        for (unsigned q = 0; q < SG_TILE * SG_K / 256; q++) {
            unsigned e = threadIdx.x + 256 * q;
            unsigned r = e / SG_K, c = e % SG_K;
            As[c][r] = A[(row0 + r) * n + k0 + c];
            unsigned kr = e / SG_TILE, cc = e % SG_TILE;
            Bs[kr][cc] = B[(uint64_t)(k0 + kr) * n + col0 + cc];
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < SG_K; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = As[k][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = Bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) C[(row0 + ty * 4 + i) * n + col0 + tx + 16 * j] = acc[i][j];
}
