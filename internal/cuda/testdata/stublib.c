// A stand-in for libcuda.so.1, built by load_cgo_test.go to check the
// binding's calling conventions without a GPU: every required entry point
// exists; the ones below act on host memory so that results are observable.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { int type; int id; } loc;
typedef struct { int srcAccessOrder; loc src, dst; unsigned int flags; } attrs;

#define OK(name) CUresult name(void) { return 0; }
OK(cuInit) OK(cuDeviceGetCount) OK(cuDeviceGet) OK(cuDeviceGetAttribute)
OK(cuDeviceTotalMem_v2) OK(cuDevicePrimaryCtxRetain) OK(cuDevicePrimaryCtxRelease_v2) OK(cuCtxSetCurrent)
OK(cuCtxSynchronize) OK(cuCtxGetStreamPriorityRange) OK(cuMemGetInfo_v2) OK(cuMemHostRegister_v2)
OK(cuMemHostUnregister) OK(cuMemHostGetDevicePointer_v2) OK(cuMemHostAlloc) OK(cuMemFreeHost) OK(cuMemFree_v2)
OK(cuMemsetD8_v2) OK(cuMemcpyAsync) OK(cuMemcpy2DAsync_v2) OK(cuStreamCreateWithPriority) OK(cuStreamDestroy_v2)
OK(cuStreamSynchronize) OK(cuStreamWaitEvent) OK(cuStreamIsCapturing) OK(cuStreamBeginCapture_v2)
OK(cuStreamEndCapture) OK(cuEventCreate) OK(cuEventDestroy_v2) OK(cuEventRecord) OK(cuEventRecordWithFlags)
OK(cuEventSynchronize) OK(cuEventElapsedTime) OK(cuThreadExchangeStreamCaptureMode)
OK(cuModuleLoadData) OK(cuModuleUnload) OK(cuModuleGetFunction) OK(cuGraphInstantiateWithFlags)
OK(cuGraphLaunch) OK(cuGraphDestroy) OK(cuGraphExecDestroy)

CUresult cuDriverGetVersion(int* v) { *v = 12080; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = (void*)0xc0c0; return 0; }
CUresult cuGetErrorName(CUresult c, const char** s) { *s = c == 2 ? "STUB_OUT_OF_MEMORY" : "STUB_ERROR"; return 0; }
CUresult cuGetErrorString(CUresult c, const char** s) { *s = "stub says no"; return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) { return 2; }
CUresult cuStreamQuery(void* s) { return 600; }
CUresult cuEventQuery(void* e) { return 0; }
CUresult cuDeviceGetName(char* s, int n, int dev) { strncpy(s, "Stub GPU", n); return 0; }
CUresult cuDeviceGetPCIBusId(char* s, int n, int dev) { strncpy(s, "0000:19:00.0", n); return 0; }
// Every address from 0x10000 up lies in a 64 KiB allocation aligned to
// 64 KiB; lower addresses are in none.
CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
	if (p < 0x10000) return 500;
	*base = p & ~(CUdeviceptr)0xffff;
	*size = 0x10000;
	return 0;
}
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { memmove((void*)d, (void*)s, n); return 0; }

// Copies like the driver; a batch of one fails naming copy 0, and wrong
// attributes fail with no index.
CUresult cuMemcpyBatchAsync(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t count, attrs* a,
		size_t* idx, size_t nattrs, size_t* fail, void* stream) {
	if (nattrs != 1 || idx[0] != 0 || a->srcAccessOrder != 1 || a->flags != 0 || stream == NULL) {
		*fail = SIZE_MAX;
		return 1;
	}
	if (count == 1) {
		*fail = 0;
		return 1;
	}
	for (size_t i = 0; i < count; i++) memmove((void*)d[i], (void*)s[i], n[i]);
	return 0;
}

// The kernel "stores param 1 (uint32) at param 0 (pointer)" and checks the
// launch geometry arrived intact.
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
		unsigned shared, void* stream, void** params, void** extra) {
	if (gx != 2 || gy != 3 || gz != 4 || bx != 32 || by != 1 || bz != 1 || shared != 7 || extra != NULL) return 1;
	uint32_t* dst = *(uint32_t**)params[0];
	*dst = *(uint32_t*)params[1];
	return 0;
}
