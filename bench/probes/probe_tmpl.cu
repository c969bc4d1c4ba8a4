// probe_tmpl: does a template launch (kvo_copy_tmpl: one table entry a
// block, each warp computing its descriptor from the block and a template
// piece) move a TP=4 rank's heads as fast as one launch of kvo_copy over
// every descriptor, and how close to the link? A standalone probe, not part
// of the engine; it includes internal/cudacopy/kernels.cu as it is:
//
//   nvcc -O3 -arch=sm_90 -o /tmp/probe_tmpl bench/probes/probe_tmpl.cu && /tmp/probe_tmpl
//
// The pattern is BenchmarkGPUHeadSliced's: an 8-KV-head model, head dim
// 128, bf16, 16-token blocks, 32 layers; the rank holds heads [2, 4). On the
// device, per layer K and V, a tensor [blocks, 16 tokens, 2 heads, 128]; on
// the host, 2 MiB slots holding every head, head-major (per layer K then V,
// each head's 16 tokens contiguous). 1024 blocks, their device ids and
// slots shuffled: 512 MiB a run, best of REPS, CUDA events on one stream.
// Each method's result is checked against the host pattern, byte for byte.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../internal/cudacopy/kernels.cu"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const int LAYERS = 32, HEADS = 8, FIRST = 2, COUNT = 2, TOKENS = 16, ROW = 256, NB = 1024, REPS = 5;
static const uint64_t HEAD = (uint64_t)TOKENS * ROW;              // 4 KiB: one head's tokens
static const uint64_t KVHOST = HEAD * HEADS;                      // one layer's K in a slot
static const uint64_t SLOT = KVHOST * 2 * LAYERS;                 // 2 MiB
static const uint64_t DEVBLOCK = (uint64_t)TOKENS * COUNT * ROW;  // 8 KiB: a block of one tensor
static const uint64_t RANK = DEVBLOCK * 2 * LAYERS;               // 512 KiB a block

static uint64_t aux2d(uint64_t rows, uint64_t sp, uint64_t dp) { return rows << 48 | (sp / 16) << 24 | dp / 16; }

int main() {
    char *host, *check, *dev;
    CK(cudaHostAlloc((void**)&host, SLOT * NB, cudaHostAllocPortable));
    CK(cudaHostAlloc((void**)&check, SLOT * NB, cudaHostAllocPortable));
    CK(cudaMalloc((void**)&dev, RANK * NB));
    char* contig;
    CK(cudaMalloc((void**)&contig, RANK * NB));
    for (uint64_t i = 0; i < SLOT * NB / 8; i++) {
        uint64_t x = i * 0x9E3779B97F4A7C15ull + 1;
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        ((uint64_t*)host)[i] = x ^ (x >> 27);
    }
    std::mt19937_64 rng(7);
    std::vector<uint32_t> ids(NB), slots(NB);
    for (int i = 0; i < NB; i++) ids[i] = slots[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::shuffle(slots.begin(), slots.end(), rng);
    auto tensor = [&](int l, int kv) { return dev + (uint64_t)(2 * l + kv) * NB * DEVBLOCK; };

    // The template, per direction; the blocks.
    std::vector<TDesc> th2d, td2h;
    for (int l = 0; l < LAYERS; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < COUNT; h++) {
                TDesc t = {};
                t.dev = (uint64_t)tensor(l, kv) + h * ROW;
                t.stride = DEVBLOCK;
                t.host_off = (uint64_t)(2 * l + kv) * KVHOST + (FIRST + h) * HEAD;
                t.len = ROW;
                t.aux = aux2d(TOKENS, ROW, COUNT * ROW);
                th2d.push_back(t);
                t.aux = aux2d(TOKENS, COUNT * ROW, ROW);
                td2h.push_back(t);
            }
    const uint32_t NT = th2d.size();
    std::vector<TBlock> blocks(NB);
    // Full descriptor tables (kvo_copy's), per direction, from the same template.
    std::vector<Desc> dh2d, dd2h;
    for (int b = 0; b < NB; b++) {
        blocks[b].host = (uint64_t)(host + slots[b] * SLOT);
        blocks[b].id = ids[b];
        for (uint32_t k = 0; k < NT; k++) {
            uint64_t hp = blocks[b].host + th2d[k].host_off, dp = th2d[k].dev + ids[b] * DEVBLOCK;
            dh2d.push_back({hp, dp, ROW, th2d[k].aux});
            dd2h.push_back({dp, hp - (uint64_t)host + (uint64_t)check, ROW, td2h[k].aux});
        }
    }
    auto upTmpl = [&](const std::vector<TDesc>& t, char* hostBase, int from = 0, int to = NB) {
        std::vector<char> buf(t.size() * sizeof(TDesc) + (to - from) * sizeof(TBlock));
        memcpy(buf.data(), t.data(), t.size() * sizeof(TDesc));
        std::vector<TBlock> bl(blocks.begin() + from, blocks.begin() + to);
        for (auto& x : bl) x.host = x.host - (uint64_t)host + (uint64_t)hostBase;
        memcpy(buf.data() + t.size() * sizeof(TDesc), bl.data(), bl.size() * sizeof(TBlock));
        void* d;
        CK(cudaMalloc(&d, buf.size()));
        CK(cudaMemcpy(d, buf.data(), buf.size(), cudaMemcpyHostToDevice));
        return (TDesc*)d;
    };
    TDesc* tH2D = upTmpl(th2d, host);
    TDesc* tD2H = upTmpl(td2h, check);
    std::vector<TDesc*> parts8;
    for (int i = 0; i < 8; i++) parts8.push_back(upTmpl(th2d, host, i * NB / 8, (i + 1) * NB / 8));
    Desc *fH2D, *fD2H;
    CK(cudaMalloc((void**)&fH2D, dh2d.size() * sizeof(Desc)));
    CK(cudaMalloc((void**)&fD2H, dd2h.size() * sizeof(Desc)));
    CK(cudaMemcpy(fH2D, dh2d.data(), dh2d.size() * sizeof(Desc), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(fD2H, dd2h.data(), dd2h.size() * sizeof(Desc), cudaMemcpyHostToDevice));
    const uint32_t NTOT = NT * NB;

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto timed = [&](auto&& fn) {
        float best = 1e9;
        for (int r = 0; r < REPS; r++) {
            CK(cudaEventRecord(e0, st));
            fn();
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            best = std::min(best, ms);
        }
        CK(cudaGetLastError());
        return best;
    };
    // The rank's bytes of every slot of check must equal host's; nothing
    // else of check may have been written (it is poisoned).
    auto verify = [&](const char* what) {
        long bad = 0;
        for (int b = 0; b < NB; b++) {
            const char* s = host + slots[b] * SLOT;
            const char* c = check + slots[b] * SLOT;
            for (int j = 0; j < 2 * LAYERS; j++) {
                uint64_t off = j * KVHOST;
                for (int h = 0; h < HEADS; h++) {
                    bool rank = h >= FIRST && h < FIRST + COUNT;
                    for (uint64_t x = 0; x < HEAD; x++) {
                        char want = rank ? s[off + h * HEAD + x] : (char)0xA5;
                        if (c[off + h * HEAD + x] != want) bad++;
                    }
                }
            }
        }
        printf("check %-40s wrong bytes %ld\n", what, bad);
        return bad;
    };
    // The device tensors, read back whole, against the definition of the
    // layouts (not the template): tensor (l, kv), block id, token t, local
    // head h holds slot (2l+kv)*KVHOST + (FIRST+h)*HEAD + t*ROW.
    std::vector<char> devcopy(RANK * NB);
    auto verifyDev = [&](const char* what) {
        CK(cudaMemcpy(devcopy.data(), dev, RANK * NB, cudaMemcpyDeviceToHost));
        long bad = 0;
        for (int b = 0; b < NB; b++) {
            const char* s = host + slots[b] * SLOT;
            for (int j = 0; j < 2 * LAYERS; j++) {
                const char* d = devcopy.data() + (uint64_t)j * NB * DEVBLOCK + (uint64_t)ids[b] * DEVBLOCK;
                for (int t = 0; t < TOKENS; t++)
                    for (int h = 0; h < COUNT; h++)
                        if (memcmp(d + (t * COUNT + h) * ROW, s + j * KVHOST + (FIRST + h) * HEAD + t * ROW, ROW) != 0) bad++;
            }
        }
        printf("device %-39s wrong rows %ld\n", what, bad);
        return bad;
    };
    const double bytes = (double)RANK * NB;
    float ref_h2d = timed([&] { CK(cudaMemcpyAsync(contig, host, RANK * NB, cudaMemcpyHostToDevice, st)); });
    float ref_d2h = timed([&] { CK(cudaMemcpyAsync(check, contig, RANK * NB, cudaMemcpyDeviceToHost, st)); });
    long bad = 0;
    struct Row { const char* name; float ms, ref; };
    std::vector<Row> rows;
    // kvo_copy over every descriptor, one launch (4 x 512); back with the template D2H.
    auto run = [&](const char* name, bool h2d, auto&& fn) {
        CK(cudaMemset(dev, 0x5A, RANK * NB));
        if (!h2d) {
            // The device holds the rank's heads (template H2D), check is poisoned.
            kvo_copy_tmpl<<<4, 512, 0, st>>>(tH2D, NT, NB, 1);
            CK(cudaStreamSynchronize(st));
        }
        memset(check, 0xA5, SLOT * NB);
        float ms = timed(fn);
        if (h2d) {
            bad += verifyDev(name);
            memset(check, 0xA5, SLOT * NB);
            kvo_copy_tmpl_probe<<<8, 192, 0, st>>>(tD2H, NT, NB, 0, 2, 0);
            CK(cudaStreamSynchronize(st));
        }
        bad += verify(name);
        rows.push_back({name, ms, h2d ? ref_h2d : ref_d2h});
    };
    run("h2d kvo_copy, every descriptor, 4x512", true, [&] { kvo_copy<<<4, 512, 0, st>>>(fH2D, NTOT); });
    run("h2d kvo_copy_tmpl 4x512", true, [&] { kvo_copy_tmpl<<<4, 512, 0, st>>>(tH2D, NT, NB, 1); });
    run("h2d kvo_copy_tmpl 8x512", true, [&] { kvo_copy_tmpl<<<8, 512, 0, st>>>(tH2D, NT, NB, 1); });
    run("h2d kvo_copy_tmpl 4x512, 8 launches", true, [&] {
        for (int i = 0; i < 8; i++) kvo_copy_tmpl<<<4, 512, 0, st>>>(parts8[i], NT, NB / 8, 1);
    });
    run("d2h kvo_copy_probe, every descriptor, 8x192", false, [&] { kvo_copy_probe<<<8, 192, 0, st>>>(fD2H, NTOT, 2, 0); });
    run("d2h kvo_copy_tmpl_probe 8x192 fence 2", false, [&] { kvo_copy_tmpl_probe<<<8, 192, 0, st>>>(tD2H, NT, NB, 0, 2, 0); });
    run("d2h kvo_copy_tmpl_probe 8x192 fence 1", false, [&] { kvo_copy_tmpl_probe<<<8, 192, 0, st>>>(tD2H, NT, NB, 0, 1, 0); });
    run("d2h kvo_copy_tmpl_probe 16x192 fence 2", false, [&] { kvo_copy_tmpl_probe<<<16, 192, 0, st>>>(tD2H, NT, NB, 0, 2, 0); });
    printf("\n| method | ms | GB/s | of link |\n|---|---:|---:|---:|\n");
    printf("| h2d memcpy contiguous | %.3f | %.1f | 1.000 |\n", ref_h2d, bytes / ref_h2d / 1e6);
    printf("| d2h memcpy contiguous | %.3f | %.1f | 1.000 |\n", ref_d2h, bytes / ref_d2h / 1e6);
    for (auto& r : rows) printf("| %s | %.3f | %.1f | %.3f |\n", r.name, r.ms, bytes / r.ms / 1e6, r.ref / r.ms);
    printf("\nwrong bytes in all: %ld\n", bad);
    return bad != 0;
}
