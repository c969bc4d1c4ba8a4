// probe_tma: can Hopper's bulk copies (TMA, cp.async.bulk) move KV segments
// between pinned host memory and the GPU faster than the SM load/store copy
// kernel (kvo_copy tops out near 92% of cuMemcpyAsync on the H200, 88% for
// 4 KiB descriptors)? A standalone probe, not part of the engine: it needs
// nvcc and an sm_90 GPU (the H200 machine):
//
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_tma bench/probes/probe_tma.cu && /tmp/probe_tma
//
// Patterns, each way, 512 MiB a run, best of REPS runs, CUDA events:
//   seg4k   131,072 segments of 4 KiB at random host slots and GPU slots
//   seg16k   32,768 segments of 16 KiB
//   head     a TP=4 rank's heads of an 8-KV-head model: per (block, layer,
//            K/V, head) 4 KiB contiguous on the host (head-major record),
//            16 rows of 256 B at a 2 KiB stride on the GPU (token-major)
// Methods:
//   memcpy   one cudaMemcpyAsync of the same bytes, contiguous (the link)
//   sm       one warp per descriptor, 8 16-byte loads in flight per lane
//            (kvo_copy's loop), CTAS x 512 threads
//   tma      one thread per descriptor stream: host side by one bulk copy,
//            GPU side by one bulk copy per row, through a ring of shared
//            memory slots (mbarrier-completed loads, bulk-group stores)
// Every run's bytes are checked; the table is printed last.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include <string>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// A descriptor: host side one contiguous run of rows*row bytes; GPU side
// rows runs of row bytes, gpitch apart.
struct Desc {
    uint64_t host, gpu;
    uint32_t row, rows;
    uint32_t gpitch, pad;
};

// ---- SM copy (kvo_copy's loop, generalized to rows) ----
template <bool H2D>
__global__ void __launch_bounds__(1024) sm_copy(const Desc* ds, uint32_t n) {
    unsigned lane = threadIdx.x & 31;
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nw = (gridDim.x * blockDim.x) >> 5;
    for (uint32_t w = warp; w < n; w += nw) {
        Desc d = ds[w];
        uint32_t wpr = d.row >> 4, nwords = wpr * d.rows;
        const uint4* hs = (const uint4*)d.host;
        for (uint32_t i = lane; i < nwords; i += 32 * 8) {
            uint4 r[8];
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t j = i + 32 * k;
                if (j < nwords) {
                    uint32_t q = j / wpr;
                    const uint4* src = H2D ? hs + j : (const uint4*)(d.gpu + (uint64_t)q * d.gpitch) + (j - q * wpr);
                    r[k] = *src;
                }
            }
#pragma unroll
            for (int k = 0; k < 8; k++) {
                uint32_t j = i + 32 * k;
                if (j < nwords) {
                    uint32_t q = j / wpr;
                    uint4* dst = H2D ? (uint4*)(d.gpu + (uint64_t)q * d.gpitch) + (j - q * wpr) : (uint4*)d.host + j;
                    *dst = r[k];
                }
            }
        }
    }
}

// ---- TMA bulk copies ----
__device__ __forceinline__ uint32_t sa(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void bar_init(uint32_t b) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory"); }
__device__ __forceinline__ void bar_expect(uint32_t b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool bar_try(uint32_t b, uint32_t parity) {
    uint32_t ok;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(b), "r"(parity) : "memory");
    return ok != 0;
}
__device__ __forceinline__ void bulk_load(uint32_t dst, uint64_t src, uint32_t bytes, uint32_t b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(b) : "memory");
}
__device__ __forceinline__ void bulk_store(uint64_t dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Each thread runs its own ring of S slots of slot bytes over descriptors
// t, t+T, t+2T... (T threads in the grid): the load side's bulk copies of
// descriptor k+S-1 are in flight while k's store side is issued.
template <bool H2D>
__device__ __forceinline__ void issue_load(const Desc& d, uint32_t buf, uint32_t b) {
    uint32_t bytes = d.row * d.rows;
    bar_expect(b, bytes);
    if (H2D) {
        bulk_load(buf, d.host, bytes, b);
    } else {
        for (uint32_t q = 0; q < d.rows; q++) bulk_load(buf + q * d.row, d.gpu + (uint64_t)q * d.gpitch, d.row, b);
    }
}
template <bool H2D>
__device__ __forceinline__ void issue_store(const Desc& d, uint32_t buf) {
    if (H2D) {
        for (uint32_t q = 0; q < d.rows; q++) bulk_store(d.gpu + (uint64_t)q * d.gpitch, buf + q * d.row, d.row);
    } else {
        bulk_store(d.host, buf, d.row * d.rows);
    }
    bulk_commit();
}

template <bool H2D>
__global__ void tma_copy(const Desc* ds, uint32_t n, uint32_t S, uint32_t slot) {
    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t T = blockDim.x, t = threadIdx.x;
    uint64_t* bars = (uint64_t*)smem;                         // T*S barriers
    unsigned char* bufs = smem + ((T * S * 8 + 127) & ~127u);  // T*S slots
    for (uint32_t s = 0; s < S; s++) bar_init(sa(&bars[t * S + s]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const uint32_t gt = blockIdx.x * T + t, G = gridDim.x * T;
    if (gt >= n) return;
    const uint32_t m = (n - gt + G - 1) / G;  // this thread's descriptors
    auto bar = [&](uint32_t s) { return sa(&bars[t * S + s]); };
    auto buf = [&](uint32_t s) { return sa(bufs + (size_t)(t * S + s) * slot); };
    for (uint32_t k = 0; k < S && k < m; k++) issue_load<H2D>(ds[gt + k * G], buf(k), bar(k));
    for (uint32_t k = 0; k < m; k++) {
        uint32_t s = k % S;
        while (!bar_try(bar(s), (k / S) & 1)) {
        }
        issue_store<H2D>(ds[gt + k * G], buf(s));
        // Refill the slot of the previous store once it has read its slot.
        if (k >= 1 && k - 1 + S < m) {
            bulk_wait_read<1>();
            uint32_t p = (k - 1) % S;
            issue_load<H2D>(ds[gt + (k - 1 + S) * G], buf(p), bar(p));
        }
    }
    bulk_wait_all();
}

// ---- the probe ----
struct Pattern {
    std::string name;
    std::vector<Desc> descs;
    uint64_t bytes;
};

static const uint64_t MiB = 1ull << 20;

// fill words of a buffer: word i of the buffer holds mix(i, seed)
__host__ __device__ inline uint32_t pat(uint64_t i, uint32_t seed) {
    uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
    x ^= x >> 29;
    return (uint32_t)(x * 0xBF58476D1CE4E5B9ull >> 32);
}
__global__ void fill(uint32_t* p, uint64_t n, uint32_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) p[i] = pat(i, seed);
}

// check: for each descriptor, the destination's words equal the source's
// pattern words (computed from the source offsets).
__global__ void check_h2d(const Desc* ds, uint32_t n, uint64_t hbase, uint64_t gbase, uint32_t seed, unsigned long long* bad) {
    for (uint32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < n * 64; w += gridDim.x * blockDim.x) {
        const Desc& d = ds[w / 64];
        uint32_t total = d.row * d.rows / 4;
        for (uint32_t j = w % 64; j < total; j += 64) {
            uint32_t byte = j * 4, q = byte / d.row, r = byte % d.row;
            uint32_t got = *(const uint32_t*)(d.gpu + (uint64_t)q * d.gpitch + r);
            uint32_t want = pat((d.host - hbase) / 4 + j, seed);
            if (got != want) atomicAdd(bad, 1ull);
        }
    }
}

static std::vector<Desc> segs(uint64_t hbase, uint64_t gbase, uint64_t area, uint32_t seg, uint64_t total, std::mt19937_64& rng) {
    uint64_t slots = area / seg, n = total / seg;
    std::vector<uint64_t> hs(slots), gs(slots);
    for (uint64_t i = 0; i < slots; i++) hs[i] = gs[i] = i;
    std::shuffle(hs.begin(), hs.end(), rng);
    std::shuffle(gs.begin(), gs.end(), rng);
    std::vector<Desc> d(n);
    for (uint64_t i = 0; i < n; i++) d[i] = Desc{hbase + hs[i] * seg, gbase + gs[i] * seg, seg, 1, seg, 0};
    return d;
}

int main(int argc, char** argv) {
    int REPS = 5;
    const uint64_t AREA = 2048 * MiB, TOTAL = 512 * MiB;
    std::mt19937_64 rng(7);
    unsigned char *h, *g;
    CK(cudaHostAlloc(&h, AREA, cudaHostAllocDefault));
    CK(cudaMalloc(&g, AREA));
    const uint64_t hb = (uint64_t)h, gb = (uint64_t)g;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("# probe_tma on %s, %d SMs, smem/block optin %zu\n", prop.name, prop.multiProcessorCount, prop.sharedMemPerBlockOptin);

    std::vector<Pattern> pats;
    pats.push_back({"seg4k", segs(hb, gb, AREA, 4096, TOTAL, rng), TOTAL});
    pats.push_back({"seg16k", segs(hb, gb, AREA, 16384, TOTAL, rng), TOTAL});
    {
        // TP=4 rank (heads 2, 3 of 8), 16-token blocks, head dim 128, bf16:
        // 1024 blocks x 32 layers x K/V x 2 heads of 4 KiB.
        const uint32_t NB = 1024, L = 32, H = 8, TOK = 16, ROW = 256;  // one head's row
        const uint64_t gtensor = (uint64_t)NB * TOK * H * ROW;          // 32 MiB per (layer, K/V)
        const uint64_t hrec = (uint64_t)L * 2 * H * TOK * ROW;          // 2 MiB per block
        std::vector<uint32_t> hid(NB), gid(NB);
        for (uint32_t i = 0; i < NB; i++) hid[i] = gid[i] = i;
        std::shuffle(hid.begin(), hid.end(), rng);
        std::shuffle(gid.begin(), gid.end(), rng);
        std::vector<Desc> d;
        for (uint32_t b = 0; b < NB; b++)
            for (uint32_t l = 0; l < L; l++)
                for (uint32_t kv = 0; kv < 2; kv++)
                    for (uint32_t hd = 2; hd < 4; hd++) {
                        uint64_t ho = hb + hid[b] * hrec + ((uint64_t)(l * 2 + kv) * H + hd) * TOK * ROW;
                        uint64_t go = gb + (uint64_t)(l * 2 + kv) * gtensor + (uint64_t)gid[b] * TOK * H * ROW + hd * ROW;
                        d.push_back(Desc{ho, go, ROW, TOK, H * ROW, 0});
                    }
        pats.push_back({"head", d, (uint64_t)d.size() * TOK * ROW});
    }

    auto memcpy_ms = [&](bool h2d, uint64_t bytes) {
        float best = 1e9;
        for (int r = 0; r < REPS; r++) {
            CK(cudaEventRecord(e0, st));
            if (h2d) CK(cudaMemcpyAsync(g, h, bytes, cudaMemcpyHostToDevice, st));
            else CK(cudaMemcpyAsync(h, g, bytes, cudaMemcpyDeviceToHost, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            best = std::min(best, ms);
        }
        return best;
    };

    struct Row { std::string pat, method, dir; double gbs, link; unsigned long long bad; };
    std::vector<Row> rows;
    unsigned long long* bad;
    CK(cudaMallocManaged(&bad, 8));
    Desc* dd;
    CK(cudaMalloc(&dd, 131072 * 2 * sizeof(Desc)));

    // per: descriptors a launch (0: one launch, the table uploaded before
    // the timing); side: each launch's table uploaded on a second stream
    // (an event orders the launch after it) instead of on the copy stream
    // right before the launch, as cudacopy's kernel path does.
    struct Method { std::string name; int kind; int ctas, threads, S, slot; uint32_t per; bool side; };
    std::vector<Method> methods = {
        {"sm 4x512", 0, 4, 512, 0, 0, 0, false},
        {"sm 16x512", 0, 16, 512, 0, 0, 0, false},
        {"sm 4x512, launches of 4096, upload before each", 0, 4, 512, 0, 0, 4096, false},
        {"sm 4x512, launches of 32768, upload before each", 0, 4, 512, 0, 0, 32768, false},
        {"sm 4x512, launches of 4096, uploads on a side stream", 0, 4, 512, 0, 0, 4096, true},
        {"sm 4x512, launches of 32768, uploads on a side stream", 0, 4, 512, 0, 0, 32768, true},
        {"sm 8x512, launches of 4096, uploads on a side stream", 0, 8, 512, 0, 0, 4096, true},
        {"tma 16x16 S3", 1, 16, 16, 3, 4096, 0, false},
        {"tma 64x8 S4", 1, 64, 8, 4, 4096, 0, false},
    };
    Desc* hd;  // the tables in pinned memory, as cudacopy writes them
    CK(cudaHostAlloc(&hd, 131072 * 2 * sizeof(Desc), cudaHostAllocDefault));
    cudaStream_t up;
    CK(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> upev(64);
    for (auto& e : upev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CK(cudaFuncSetAttribute(tma_copy<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    CK(cudaFuncSetAttribute(tma_copy<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));

    for (int dirh = 1; dirh >= 0; dirh--) {
        bool h2d = dirh == 1;
        for (auto& p : pats) {
            // seg16k needs 16 KiB slots: the tma methods take 4x fewer slots per thread there.
            CK(cudaMemcpy(dd, p.descs.data(), p.descs.size() * sizeof(Desc), cudaMemcpyHostToDevice));
            memcpy(hd, p.descs.data(), p.descs.size() * sizeof(Desc));
            uint32_t n = (uint32_t)p.descs.size();
            uint32_t dlen = p.descs[0].row * p.descs[0].rows;
            float link = std::min(memcpy_ms(h2d, p.bytes), memcpy_ms(h2d, p.bytes));
            double linkgbs = p.bytes / (link * 1e6);
            rows.push_back({p.name, "memcpy contiguous", h2d ? "h2d" : "d2h", linkgbs, 1.0, 0});
            for (auto& m : methods) {
                int threads = m.threads, S = m.S;
                uint32_t slot = std::max<uint32_t>(m.slot, dlen);
                size_t smem = 0;
                if (m.kind == 1) {
                    while ((size_t)threads * S * slot + threads * S * 8 + 128 > 200 * 1024 && threads > 1) threads /= 2;
                    smem = (size_t)threads * S * slot + ((threads * S * 8 + 127) & ~127u);
                }
                // fill the source, poison the destination
                if (h2d) {
                    fill<<<1024, 256, 0, st>>>((uint32_t*)h, AREA / 4, 11);
                    CK(cudaMemsetAsync(g, 0xA5, AREA, st));
                } else {
                    fill<<<1024, 256, 0, st>>>((uint32_t*)g, AREA / 4, 13);
                    memset(h, 0x5A, AREA);
                }
                CK(cudaStreamSynchronize(st));
                float best = 1e9;
                for (int r = 0; r < REPS; r++) {
                    CK(cudaEventRecord(e0, st));
                    if (m.kind == 0 && m.per != 0) {
                        for (uint32_t off = 0, k = 0; off < n; off += m.per, k++) {
                            uint32_t c = std::min(m.per, n - off);
                            if (m.side) {
                                CK(cudaMemcpyAsync(dd + off, hd + off, c * sizeof(Desc), cudaMemcpyHostToDevice, up));
                                CK(cudaEventRecord(upev[k % upev.size()], up));
                                CK(cudaStreamWaitEvent(st, upev[k % upev.size()], 0));
                            } else {
                                CK(cudaMemcpyAsync(dd + off, hd + off, c * sizeof(Desc), cudaMemcpyHostToDevice, st));
                            }
                            if (h2d) sm_copy<true><<<m.ctas, threads, 0, st>>>(dd + off, c);
                            else sm_copy<false><<<m.ctas, threads, 0, st>>>(dd + off, c);
                        }
                    } else if (m.kind == 0) {
                        if (h2d) sm_copy<true><<<m.ctas, threads, 0, st>>>(dd, n);
                        else sm_copy<false><<<m.ctas, threads, 0, st>>>(dd, n);
                    } else {
                        if (h2d) tma_copy<true><<<m.ctas, threads, smem, st>>>(dd, n, S, slot);
                        else tma_copy<false><<<m.ctas, threads, smem, st>>>(dd, n, S, slot);
                    }
                    CK(cudaGetLastError());
                    CK(cudaEventRecord(e1, st));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    best = std::min(best, ms);
                }
                // check every byte
                unsigned long long nbad = 0;
                if (h2d) {
                    *bad = 0;
                    check_h2d<<<1024, 256, 0, st>>>(dd, n, hb, gb, 11, bad);
                    CK(cudaStreamSynchronize(st));
                    nbad = *bad;
                } else {
                    for (auto& d : p.descs) {
                        for (uint32_t q = 0; q < d.rows; q++) {
                            uint64_t goff = d.gpu + (uint64_t)q * d.gpitch - gb;
                            const uint32_t* got = (const uint32_t*)(d.host + (uint64_t)q * d.row);
                            for (uint32_t j = 0; j < d.row / 4; j++)
                                if (got[j] != pat(goff / 4 + j, 13)) nbad++;
                        }
                    }
                }
                char nm[64];
                snprintf(nm, sizeof nm, "%s%s", m.name.c_str(), threads != m.threads ? " (fewer threads)" : "");
                rows.push_back({p.name, nm, h2d ? "h2d" : "d2h", p.bytes / (best * 1e6), p.bytes / (best * 1e6) / linkgbs, nbad});
            }
        }
    }
    printf("\n| pattern | dir | method | GB/s | of link | wrong words |\n|---|---|---|---:|---:|---:|\n");
    for (auto& r : rows) printf("| %s | %s | %s | %.1f | %.3f | %llu |\n", r.pat.c_str(), r.dir.c_str(), r.method.c_str(), r.gbs, r.link, r.bad);
    return 0;
}
