//go:build cgo

package cuda

/*
#include <stdlib.h>
#include <string.h>
#include <stdint.h>

// The driver API types the binding needs, declared here so that no CUDA
// header or toolkit is required to build.
typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUgraph;
typedef void* CUgraphExec;
typedef unsigned long long CUdeviceptr;

// CUmemLocation and CUmemcpyAttributes as in cuda.h 12.8+.
typedef struct { int type; int id; } kvo_CUmemLocation;
typedef struct {
	int srcAccessOrder;            // CUmemcpySrcAccessOrder
	kvo_CUmemLocation srcLocHint;
	kvo_CUmemLocation dstLocHint;
	unsigned int flags;
} kvo_CUmemcpyAttributes;

#define KVO_SRC_ACCESS_ORDER_STREAM 1

// Trampolines: call a driver function through the pointer dlsym returned.
static CUresult kvo_u(void* f, unsigned int a) { return ((CUresult(*)(unsigned int))f)(a); }
static CUresult kvo_pi(void* f, int* a) { return ((CUresult(*)(int*))f)(a); }
static CUresult kvo_pi_pi(void* f, int* a, int* b) { return ((CUresult(*)(int*, int*))f)(a, b); }
static CUresult kvo_dev_get(void* f, CUdevice* d, int o) { return ((CUresult(*)(CUdevice*, int))f)(d, o); }
static CUresult kvo_str_dev(void* f, char* s, int n, CUdevice d) { return ((CUresult(*)(char*, int, CUdevice))f)(s, n, d); }
static CUresult kvo_attr(void* f, int* v, int a, CUdevice d) { return ((CUresult(*)(int*, int, CUdevice))f)(v, a, d); }
static CUresult kvo_size_dev(void* f, size_t* v, CUdevice d) { return ((CUresult(*)(size_t*, CUdevice))f)(v, d); }
static CUresult kvo_size_size(void* f, size_t* a, size_t* b) { return ((CUresult(*)(size_t*, size_t*))f)(a, b); }
static CUresult kvo_ctx_retain(void* f, CUcontext* c, CUdevice d) { return ((CUresult(*)(CUcontext*, CUdevice))f)(c, d); }
static CUresult kvo_ctx_get(void* f, uintptr_t* c) {
	CUcontext q = NULL;
	CUresult r = ((CUresult(*)(CUcontext*))f)(&q);
	*c = (uintptr_t)q;
	return r;
}
static CUresult kvo_dev(void* f, CUdevice d) { return ((CUresult(*)(CUdevice))f)(d); }
static CUresult kvo_ptr(void* f, void* p) { return ((CUresult(*)(void*))f)(p); }
static CUresult kvo_void(void* f) { return ((CUresult(*)(void))f)(); }
static CUresult kvo_register(void* f, uintptr_t p, size_t n, unsigned int fl) { return ((CUresult(*)(void*, size_t, unsigned int))f)((void*)p, n, fl); }
static CUresult kvo_uptr(void* f, uintptr_t p) { return ((CUresult(*)(void*))f)((void*)p); }
static CUresult kvo_devptr_of(void* f, CUdeviceptr* d, uintptr_t p, unsigned int fl) { return ((CUresult(*)(CUdeviceptr*, void*, unsigned int))f)(d, (void*)p, fl); }
static CUresult kvo_host_alloc(void* f, void** p, size_t n, unsigned int fl) { return ((CUresult(*)(void**, size_t, unsigned int))f)(p, n, fl); }
static CUresult kvo_alloc(void* f, CUdeviceptr* d, size_t n) { return ((CUresult(*)(CUdeviceptr*, size_t))f)(d, n); }
static CUresult kvo_addr_range(void* f, CUdeviceptr* base, size_t* size, CUdeviceptr p) {
	return ((CUresult(*)(CUdeviceptr*, size_t*, CUdeviceptr))f)(base, size, p);
}
static CUresult kvo_dptr(void* f, CUdeviceptr d) { return ((CUresult(*)(CUdeviceptr))f)(d); }
static CUresult kvo_memset(void* f, CUdeviceptr d, unsigned char v, size_t n) { return ((CUresult(*)(CUdeviceptr, unsigned char, size_t))f)(d, v, n); }
static CUresult kvo_memcpy(void* f, CUdeviceptr d, CUdeviceptr s, size_t n) { return ((CUresult(*)(CUdeviceptr, CUdeviceptr, size_t))f)(d, s, n); }
static CUresult kvo_memcpy_async(void* f, CUdeviceptr d, CUdeviceptr s, size_t n, uintptr_t st) {
	return ((CUresult(*)(CUdeviceptr, CUdeviceptr, size_t, CUstream))f)(d, s, n, (CUstream)st);
}

// kvo_CUDA_MEMCPY2D is CUDA_MEMCPY2D (v2): CUmemorytype is an enum (int).
typedef struct {
	size_t srcXInBytes, srcY;
	int srcMemoryType;
	const void* srcHost;
	CUdeviceptr srcDevice;
	void* srcArray;
	size_t srcPitch;
	size_t dstXInBytes, dstY;
	int dstMemoryType;
	void* dstHost;
	CUdeviceptr dstDevice;
	void* dstArray;
	size_t dstPitch;
	size_t WidthInBytes, Height;
} kvo_CUDA_MEMCPY2D;

// kvo_memcpy2d_async calls cuMemcpy2DAsync_v2 between unified addresses
// (CU_MEMORYTYPE_UNIFIED = 4 on both sides).
static CUresult kvo_memcpy2d_async(void* f, CUdeviceptr d, size_t dp, CUdeviceptr s, size_t sp, size_t w, size_t h, uintptr_t st) {
	kvo_CUDA_MEMCPY2D p;
	memset(&p, 0, sizeof p);
	p.srcMemoryType = 4;
	p.srcDevice = s;
	p.srcPitch = sp;
	p.dstMemoryType = 4;
	p.dstDevice = d;
	p.dstPitch = dp;
	p.WidthInBytes = w;
	p.Height = h;
	return ((CUresult(*)(const kvo_CUDA_MEMCPY2D*, CUstream))f)(&p, (CUstream)st);
}

// kvo_batch calls cuMemcpyBatchAsync (v1, with failIdx; or v2, without) with
// one attribute set, stream-ordered source access, for all count copies.
static CUresult kvo_batch(void* f, int v2, CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count, size_t* failIdx, uintptr_t st) {
	kvo_CUmemcpyAttributes attr;
	memset(&attr, 0, sizeof attr);
	attr.srcAccessOrder = KVO_SRC_ACCESS_ORDER_STREAM;
	size_t attrIdx = 0;
	*failIdx = SIZE_MAX;
	if (v2) {
		return ((CUresult(*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, kvo_CUmemcpyAttributes*, size_t*, size_t, CUstream))f)(
			dsts, srcs, sizes, count, &attr, &attrIdx, 1, (CUstream)st);
	}
	return ((CUresult(*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, kvo_CUmemcpyAttributes*, size_t*, size_t, size_t*, CUstream))f)(
		dsts, srcs, sizes, count, &attr, &attrIdx, 1, failIdx, (CUstream)st);
}

static CUresult kvo_stream_create(void* f, uintptr_t* s, unsigned int fl, int prio) {
	CUstream q = NULL;
	CUresult r = ((CUresult(*)(CUstream*, unsigned int, int))f)(&q, fl, prio);
	*s = (uintptr_t)q;
	return r;
}
static CUresult kvo_h(void* f, uintptr_t h) { return ((CUresult(*)(void*))f)((void*)h); }
static CUresult kvo_h_h(void* f, uintptr_t a, uintptr_t b) { return ((CUresult(*)(void*, void*))f)((void*)a, (void*)b); }
static CUresult kvo_h_h_u(void* f, uintptr_t a, uintptr_t b, unsigned int c) { return ((CUresult(*)(void*, void*, unsigned int))f)((void*)a, (void*)b, c); }
static CUresult kvo_h_pi(void* f, uintptr_t a, int* b) { return ((CUresult(*)(void*, int*))f)((void*)a, b); }
static CUresult kvo_h_i(void* f, uintptr_t a, int b) { return ((CUresult(*)(void*, int))f)((void*)a, b); }
static CUresult kvo_h_out(void* f, uintptr_t a, uintptr_t* out) {
	void* q = NULL;
	CUresult r = ((CUresult(*)(void*, void**))f)((void*)a, &q);
	*out = (uintptr_t)q;
	return r;
}
static CUresult kvo_event_create(void* f, uintptr_t* e, unsigned int fl) {
	CUevent q = NULL;
	CUresult r = ((CUresult(*)(CUevent*, unsigned int))f)(&q, fl);
	*e = (uintptr_t)q;
	return r;
}
static CUresult kvo_elapsed(void* f, float* ms, uintptr_t a, uintptr_t b) { return ((CUresult(*)(float*, CUevent, CUevent))f)(ms, (CUevent)a, (CUevent)b); }
static CUresult kvo_module_load(void* f, uintptr_t* m, const void* image) {
	CUmodule q = NULL;
	CUresult r = ((CUresult(*)(CUmodule*, const void*))f)(&q, image);
	*m = (uintptr_t)q;
	return r;
}
static CUresult kvo_get_function(void* f, uintptr_t* fn, uintptr_t m, const char* name) {
	CUfunction q = NULL;
	CUresult r = ((CUresult(*)(CUfunction*, CUmodule, const char*))f)(&q, (CUmodule)m, name);
	*fn = (uintptr_t)q;
	return r;
}
static CUresult kvo_launch(void* f, uintptr_t fn, unsigned int gx, unsigned int gy, unsigned int gz,
		unsigned int bx, unsigned int by, unsigned int bz, unsigned int shared, uintptr_t st, void** params) {
	return ((CUresult(*)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
		unsigned int, CUstream, void**, void**))f)((CUfunction)fn, gx, gy, gz, bx, by, bz, shared, (CUstream)st, params, NULL);
}
static CUresult kvo_graph_instantiate(void* f, uintptr_t* ge, uintptr_t g) {
	CUgraphExec q = NULL;
	CUresult r = ((CUresult(*)(CUgraphExec*, CUgraph, unsigned long long))f)(&q, (CUgraph)g, 0);
	*ge = (uintptr_t)q;
	return r;
}
static CUresult kvo_error_str(void* f, CUresult code, const char** s) { return ((CUresult(*)(CUresult, const char**))f)(code, s); }
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// libName is the driver library Load opens; tests point loadFrom elsewhere.
const libName = "libcuda.so.1"

// symbols holds the bound driver entry points.
type symbols struct {
	init, driverGetVersion, deviceGetCount, deviceGet, deviceGetName, deviceGetAttribute,
	deviceGetPCIBusID, deviceTotalMem, primaryCtxRetain, primaryCtxRelease, ctxSetCurrent, ctxGetCurrent,
	ctxSynchronize, ctxGetStreamPriorityRange, memGetInfo, memHostRegister, memHostUnregister,
	memHostGetDevicePointer, memHostAlloc, memFreeHost, memAlloc, memFree, memsetD8, memGetAddressRange, memcpy,
	memcpyAsync, memcpy2DAsync, memcpyBatchAsync, streamCreateWithPriority, streamDestroy, streamSynchronize,
	streamQuery, streamWaitEvent, streamIsCapturing, streamBeginCapture, streamEndCapture,
	eventCreate, eventDestroy, eventRecord, eventRecordWithFlags, eventQuery, eventSynchronize,
	eventElapsedTime, threadExchangeStreamCaptureMode, moduleLoadData, moduleUnload,
	moduleGetFunction, launchKernel, graphInstantiate, graphLaunch, graphDestroy,
	graphExecDestroy, getErrorName, getErrorString unsafe.Pointer
}

// libcuda is the Driver bound to the real libcuda.
type libcuda struct {
	lib     *library
	s       symbols
	batchV2 bool // cuMemcpyBatchAsync is the _v2 form, without failIdx
}

// Load binds libcuda.so.1 and calls cuInit(0). It returns an error wrapping
// ErrNoDriver when the library or a required symbol is missing, or when
// cuInit fails (no device, stub library); the cuInit error is wrapped too.
func Load() (Driver, error) { return loadFrom(libName) }

// binding is one entry point and the symbols that provide it, best first.
type binding struct {
	dst      *unsafe.Pointer
	names    []string
	optional bool
}

// bindings lists every entry point of d.
func (d *libcuda) bindings() []binding {
	s := &d.s
	return []binding{
		{&s.init, []string{OpInit}, false},
		{&s.getErrorName, []string{"cuGetErrorName"}, false},
		{&s.getErrorString, []string{"cuGetErrorString"}, false},
		{&s.driverGetVersion, []string{OpDriverVersion}, false},
		{&s.deviceGetCount, []string{OpDeviceCount}, false},
		{&s.deviceGet, []string{OpDeviceGet}, false},
		{&s.deviceGetName, []string{OpDeviceName}, false},
		{&s.deviceGetAttribute, []string{OpDeviceAttribute}, false},
		{&s.deviceGetPCIBusID, []string{OpDevicePCIBusID}, false},
		{&s.deviceTotalMem, []string{OpDeviceTotalMem}, false},
		{&s.primaryCtxRetain, []string{OpPrimaryCtxRetain}, false},
		{&s.primaryCtxRelease, []string{OpPrimaryCtxRelease}, false},
		{&s.ctxSetCurrent, []string{OpCtxSetCurrent}, false},
		{&s.ctxGetCurrent, []string{OpCtxGetCurrent}, false},
		{&s.ctxSynchronize, []string{OpCtxSynchronize}, false},
		{&s.ctxGetStreamPriorityRange, []string{OpStreamPriorityRange}, false},
		{&s.memGetInfo, []string{OpMemGetInfo}, false},
		{&s.memHostRegister, []string{OpMemHostRegister}, false},
		{&s.memHostUnregister, []string{OpMemHostUnregister}, false},
		{&s.memHostGetDevicePointer, []string{OpMemHostGetDevicePointer}, false},
		{&s.memHostAlloc, []string{OpMemHostAlloc}, false},
		{&s.memFreeHost, []string{OpMemFreeHost}, false},
		{&s.memAlloc, []string{OpMemAlloc}, false},
		{&s.memFree, []string{OpMemFree}, false},
		{&s.memsetD8, []string{OpMemsetD8}, false},
		{&s.memGetAddressRange, []string{OpMemGetAddressRange}, false},
		{&s.memcpy, []string{OpMemcpy}, false},
		{&s.memcpyAsync, []string{OpMemcpyAsync}, false},
		{&s.memcpy2DAsync, []string{OpMemcpy2DAsync + "_v2"}, false},
		{&s.streamCreateWithPriority, []string{OpStreamCreate}, false},
		{&s.streamDestroy, []string{OpStreamDestroy}, false},
		{&s.streamSynchronize, []string{OpStreamSynchronize}, false},
		{&s.streamQuery, []string{OpStreamQuery}, false},
		{&s.streamWaitEvent, []string{OpStreamWaitEvent}, false},
		{&s.streamIsCapturing, []string{OpStreamIsCapturing}, false},
		{&s.streamBeginCapture, []string{OpStreamBeginCapture}, false},
		{&s.streamEndCapture, []string{OpStreamEndCapture}, false},
		{&s.eventCreate, []string{OpEventCreate}, false},
		{&s.eventDestroy, []string{OpEventDestroy}, false},
		{&s.eventRecord, []string{OpEventRecord}, false},
		{&s.eventRecordWithFlags, []string{OpEventRecordWithFlags}, false},
		{&s.eventQuery, []string{OpEventQuery}, false},
		{&s.eventSynchronize, []string{OpEventSynchronize}, false},
		{&s.eventElapsedTime, []string{"cuEventElapsedTime_v2", OpEventElapsedTime}, false},
		{&s.threadExchangeStreamCaptureMode, []string{OpThreadExchangeStreamCaptureMode}, false},
		{&s.moduleLoadData, []string{OpModuleLoadData}, false},
		{&s.moduleUnload, []string{OpModuleUnload}, false},
		{&s.moduleGetFunction, []string{OpModuleGetFunction}, false},
		{&s.launchKernel, []string{OpLaunchKernel}, false},
		{&s.graphInstantiate, []string{OpGraphInstantiate}, false},
		{&s.graphLaunch, []string{OpGraphLaunch}, false},
		{&s.graphDestroy, []string{OpGraphDestroy}, false},
		{&s.graphExecDestroy, []string{OpGraphExecDestroy}, false},
		{&s.memcpyBatchAsync, []string{OpMemcpyBatchAsync}, true},
	}
}

func loadFrom(path string) (Driver, error) {
	lib, err := dlopen(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrNoDriver, path, err)
	}
	d := &libcuda{lib: lib}
	for _, b := range d.bindings() {
		for _, name := range b.names {
			if p, err := lib.sym(name); err == nil {
				*b.dst = p
				break
			}
		}
		if *b.dst == nil && !b.optional {
			_ = lib.close()
			return nil, fmt.Errorf("%w: %s does not export %s", ErrNoDriver, path, b.names[len(b.names)-1])
		}
	}
	if d.s.memcpyBatchAsync == nil {
		if p, err := lib.sym(OpMemcpyBatchAsync + "_v2"); err == nil {
			d.s.memcpyBatchAsync, d.batchV2 = p, true
		}
	}
	if err := d.check(OpInit, C.kvo_u(d.s.init, 0)); err != nil {
		_ = lib.close()
		return nil, fmt.Errorf("%w: %s: %w", ErrNoDriver, path, err)
	}
	return d, nil
}

// check turns a CUresult into nil or an *Error named by the driver.
func (d *libcuda) check(op string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	e := NewError(op, Result(r))
	var s *C.char
	if C.kvo_error_str(d.s.getErrorName, r, &s) == 0 && s != nil {
		e.Name = C.GoString(s)
	}
	s = nil
	if C.kvo_error_str(d.s.getErrorString, r, &s) == 0 && s != nil {
		e.Text = C.GoString(s)
	}
	return e
}

func (d *libcuda) DriverVersion() (int, error) {
	var v C.int
	return int(v), d.check(OpDriverVersion, C.kvo_pi(d.s.driverGetVersion, &v))
}

func (d *libcuda) DeviceCount() (int, error) {
	var n C.int
	return int(n), d.check(OpDeviceCount, C.kvo_pi(d.s.deviceGetCount, &n))
}

func (d *libcuda) DeviceGet(ordinal int) (Device, error) {
	var dev C.CUdevice
	if err := d.check(OpDeviceGet, C.kvo_dev_get(d.s.deviceGet, &dev, C.int(ordinal))); err != nil {
		return 0, err
	}
	return Device(dev), nil
}

// deviceString calls a (char*, int, CUdevice) query into C memory.
func (d *libcuda) deviceString(op string, f unsafe.Pointer, dev Device) (string, error) {
	const n = 256
	buf := (*C.char)(C.calloc(n, 1))
	defer C.free(unsafe.Pointer(buf))
	if err := d.check(op, C.kvo_str_dev(f, buf, n, C.CUdevice(dev))); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}

func (d *libcuda) DeviceName(dev Device) (string, error) {
	return d.deviceString(OpDeviceName, d.s.deviceGetName, dev)
}

func (d *libcuda) DevicePCIBusID(dev Device) (string, error) {
	return d.deviceString(OpDevicePCIBusID, d.s.deviceGetPCIBusID, dev)
}

func (d *libcuda) DeviceAttribute(attr Attribute, dev Device) (int, error) {
	var v C.int
	return int(v), d.check(OpDeviceAttribute, C.kvo_attr(d.s.deviceGetAttribute, &v, C.int(attr), C.CUdevice(dev)))
}

func (d *libcuda) DeviceTotalMem(dev Device) (uint64, error) {
	var v C.size_t
	return uint64(v), d.check(OpDeviceTotalMem, C.kvo_size_dev(d.s.deviceTotalMem, &v, C.CUdevice(dev)))
}

func (d *libcuda) MemGetInfo() (free, total uint64, err error) {
	var f, t C.size_t
	err = d.check(OpMemGetInfo, C.kvo_size_size(d.s.memGetInfo, &f, &t))
	return uint64(f), uint64(t), err
}

func (d *libcuda) PrimaryCtxRetain(dev Device) (Context, error) {
	var c C.CUcontext
	if err := d.check(OpPrimaryCtxRetain, C.kvo_ctx_retain(d.s.primaryCtxRetain, &c, C.CUdevice(dev))); err != nil {
		return 0, err
	}
	return Context(uintptr(c)), nil
}

func (d *libcuda) PrimaryCtxRelease(dev Device) error {
	return d.check(OpPrimaryCtxRelease, C.kvo_dev(d.s.primaryCtxRelease, C.CUdevice(dev)))
}

func (d *libcuda) CtxSetCurrent(ctx Context) error {
	return d.check(OpCtxSetCurrent, C.kvo_h(d.s.ctxSetCurrent, C.uintptr_t(ctx)))
}

func (d *libcuda) CtxGetCurrent() (Context, error) {
	var c C.uintptr_t
	if err := d.check(OpCtxGetCurrent, C.kvo_ctx_get(d.s.ctxGetCurrent, &c)); err != nil {
		return 0, err
	}
	return Context(c), nil
}

func (d *libcuda) CtxSynchronize() error {
	return d.check(OpCtxSynchronize, C.kvo_void(d.s.ctxSynchronize))
}

func (d *libcuda) StreamPriorityRange() (least, greatest int, err error) {
	var l, g C.int
	err = d.check(OpStreamPriorityRange, C.kvo_pi_pi(d.s.ctxGetStreamPriorityRange, &l, &g))
	return int(l), int(g), err
}

func (d *libcuda) MemHostRegister(p unsafe.Pointer, size uint64, flags uint32) error {
	return d.check(OpMemHostRegister, C.kvo_register(d.s.memHostRegister, C.uintptr_t(uintptr(p)), C.size_t(size), C.uint(flags)))
}

func (d *libcuda) MemHostUnregister(p unsafe.Pointer) error {
	return d.check(OpMemHostUnregister, C.kvo_uptr(d.s.memHostUnregister, C.uintptr_t(uintptr(p))))
}

func (d *libcuda) MemHostGetDevicePointer(p unsafe.Pointer) (DevicePtr, error) {
	var dp C.CUdeviceptr
	if err := d.check(OpMemHostGetDevicePointer, C.kvo_devptr_of(d.s.memHostGetDevicePointer, &dp, C.uintptr_t(uintptr(p)), 0)); err != nil {
		return 0, err
	}
	return DevicePtr(dp), nil
}

func (d *libcuda) MemHostAlloc(size uint64, flags uint32) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	if err := d.check(OpMemHostAlloc, C.kvo_host_alloc(d.s.memHostAlloc, &p, C.size_t(size), C.uint(flags))); err != nil {
		return nil, err
	}
	return p, nil
}

func (d *libcuda) MemFreeHost(p unsafe.Pointer) error {
	return d.check(OpMemFreeHost, C.kvo_uptr(d.s.memFreeHost, C.uintptr_t(uintptr(p))))
}

func (d *libcuda) MemAlloc(size uint64) (DevicePtr, error) {
	var dp C.CUdeviceptr
	if err := d.check(OpMemAlloc, C.kvo_alloc(d.s.memAlloc, &dp, C.size_t(size))); err != nil {
		return 0, err
	}
	return DevicePtr(dp), nil
}

func (d *libcuda) MemFree(p DevicePtr) error {
	return d.check(OpMemFree, C.kvo_dptr(d.s.memFree, C.CUdeviceptr(p)))
}

func (d *libcuda) MemsetD8(dst DevicePtr, value uint8, n uint64) error {
	return d.check(OpMemsetD8, C.kvo_memset(d.s.memsetD8, C.CUdeviceptr(dst), C.uchar(value), C.size_t(n)))
}

func (d *libcuda) MemGetAddressRange(p DevicePtr) (DevicePtr, uint64, error) {
	var base C.CUdeviceptr
	var size C.size_t
	if err := d.check(OpMemGetAddressRange, C.kvo_addr_range(d.s.memGetAddressRange, &base, &size, C.CUdeviceptr(p))); err != nil {
		return 0, 0, err
	}
	return DevicePtr(base), uint64(size), nil
}

func (d *libcuda) Memcpy(dst, src DevicePtr, n uint64) error {
	return d.check(OpMemcpy, C.kvo_memcpy(d.s.memcpy, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
}

func (d *libcuda) MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error {
	return d.check(OpMemcpyAsync, C.kvo_memcpy_async(d.s.memcpyAsync, C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n), C.uintptr_t(s)))
}

func (d *libcuda) HasMemcpyBatch() bool { return d.s.memcpyBatchAsync != nil }

// Memcpy2DAsync implements Driver.
func (d *libcuda) Memcpy2DAsync(p Memcpy2D, s Stream) error {
	return d.check(OpMemcpy2DAsync, C.kvo_memcpy2d_async(d.s.memcpy2DAsync, C.CUdeviceptr(p.Dst), C.size_t(p.DstPitch),
		C.CUdeviceptr(p.Src), C.size_t(p.SrcPitch), C.size_t(p.Width), C.size_t(p.Height), C.uintptr_t(s)))
}

// MemcpyBatchAsync builds the address and size arrays in C memory and makes
// one call. A failure the driver attributes to a copy (failIdx) is a
// *BatchError naming it.
func (d *libcuda) MemcpyBatchAsync(copies []BatchCopy, s Stream) error {
	if d.s.memcpyBatchAsync == nil {
		return NewError(OpMemcpyBatchAsync, ErrorNotSupported)
	}
	n := len(copies)
	if n == 0 {
		return &BatchError{Index: -1, Err: NewError(OpMemcpyBatchAsync, ErrorInvalidValue)}
	}
	mem := C.malloc(C.size_t(3 * 8 * n))
	if mem == nil {
		return NewError(OpMemcpyBatchAsync, ErrorOutOfMemory)
	}
	defer C.free(mem)
	all := unsafe.Slice((*C.CUdeviceptr)(mem), 3*n)
	dsts, srcs, sizes := all[:n], all[n:2*n], unsafe.Slice((*C.size_t)(unsafe.Add(mem, 16*n)), n)
	for i, c := range copies {
		dsts[i], srcs[i], sizes[i] = C.CUdeviceptr(c.Dst), C.CUdeviceptr(c.Src), C.size_t(c.Size)
	}
	var failIdx C.size_t
	v2 := C.int(0)
	if d.batchV2 {
		v2 = 1
	}
	err := d.check(OpMemcpyBatchAsync, C.kvo_batch(d.s.memcpyBatchAsync, v2, &dsts[0], &srcs[0], &sizes[0], C.size_t(n), &failIdx, C.uintptr_t(s)))
	if err == nil {
		return nil
	}
	if i := uint64(failIdx); i < uint64(n) {
		return &BatchError{Index: int(i), Copy: copies[i], Err: err}
	}
	return &BatchError{Index: -1, Err: err}
}

func (d *libcuda) StreamCreate(flags uint32, priority int) (Stream, error) {
	var s C.uintptr_t
	if err := d.check(OpStreamCreate, C.kvo_stream_create(d.s.streamCreateWithPriority, &s, C.uint(flags), C.int(priority))); err != nil {
		return 0, err
	}
	return Stream(s), nil
}

func (d *libcuda) StreamDestroy(s Stream) error {
	return d.check(OpStreamDestroy, C.kvo_h(d.s.streamDestroy, C.uintptr_t(s)))
}

func (d *libcuda) StreamSynchronize(s Stream) error {
	return d.check(OpStreamSynchronize, C.kvo_h(d.s.streamSynchronize, C.uintptr_t(s)))
}

func (d *libcuda) StreamQuery(s Stream) (bool, error) {
	return d.query(OpStreamQuery, C.kvo_h(d.s.streamQuery, C.uintptr_t(s)))
}

// query maps CUDA_ERROR_NOT_READY to (false, nil).
func (d *libcuda) query(op string, r C.CUresult) (bool, error) {
	if Result(r) == ErrorNotReady {
		return false, nil
	}
	if err := d.check(op, r); err != nil {
		return false, err
	}
	return true, nil
}

func (d *libcuda) StreamWaitEvent(s Stream, e Event, flags uint32) error {
	return d.check(OpStreamWaitEvent, C.kvo_h_h_u(d.s.streamWaitEvent, C.uintptr_t(s), C.uintptr_t(e), C.uint(flags)))
}

func (d *libcuda) StreamIsCapturing(s Stream) (CaptureStatus, error) {
	var st C.int
	err := d.check(OpStreamIsCapturing, C.kvo_h_pi(d.s.streamIsCapturing, C.uintptr_t(s), &st))
	return CaptureStatus(st), err
}

func (d *libcuda) StreamBeginCapture(s Stream, mode CaptureMode) error {
	return d.check(OpStreamBeginCapture, C.kvo_h_i(d.s.streamBeginCapture, C.uintptr_t(s), C.int(mode)))
}

func (d *libcuda) StreamEndCapture(s Stream) (Graph, error) {
	var g C.uintptr_t
	if err := d.check(OpStreamEndCapture, C.kvo_h_out(d.s.streamEndCapture, C.uintptr_t(s), &g)); err != nil {
		return 0, err
	}
	return Graph(g), nil
}

func (d *libcuda) EventCreate(flags uint32) (Event, error) {
	var e C.uintptr_t
	if err := d.check(OpEventCreate, C.kvo_event_create(d.s.eventCreate, &e, C.uint(flags))); err != nil {
		return 0, err
	}
	return Event(e), nil
}

func (d *libcuda) EventDestroy(e Event) error {
	return d.check(OpEventDestroy, C.kvo_h(d.s.eventDestroy, C.uintptr_t(e)))
}

func (d *libcuda) EventRecord(e Event, s Stream) error {
	return d.check(OpEventRecord, C.kvo_h_h(d.s.eventRecord, C.uintptr_t(e), C.uintptr_t(s)))
}

func (d *libcuda) EventRecordWithFlags(e Event, s Stream, flags uint32) error {
	return d.check(OpEventRecordWithFlags, C.kvo_h_h_u(d.s.eventRecordWithFlags, C.uintptr_t(e), C.uintptr_t(s), C.uint(flags)))
}

func (d *libcuda) EventQuery(e Event) (bool, error) {
	return d.query(OpEventQuery, C.kvo_h(d.s.eventQuery, C.uintptr_t(e)))
}

func (d *libcuda) EventSynchronize(e Event) error {
	return d.check(OpEventSynchronize, C.kvo_h(d.s.eventSynchronize, C.uintptr_t(e)))
}

func (d *libcuda) EventElapsedTime(start, end Event) (float32, error) {
	var ms C.float
	err := d.check(OpEventElapsedTime, C.kvo_elapsed(d.s.eventElapsedTime, &ms, C.uintptr_t(start), C.uintptr_t(end)))
	return float32(ms), err
}

func (d *libcuda) ThreadExchangeStreamCaptureMode(mode CaptureMode) (CaptureMode, error) {
	m := C.int(mode)
	if err := d.check(OpThreadExchangeStreamCaptureMode, C.kvo_pi(d.s.threadExchangeStreamCaptureMode, &m)); err != nil {
		return 0, err
	}
	return CaptureMode(m), nil
}

// ModuleLoadData copies the image to C memory with a terminating NUL (PTX
// is text) for the duration of the call.
func (d *libcuda) ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 {
		return 0, NewError(OpModuleLoadData, ErrorInvalidImage)
	}
	buf := C.malloc(C.size_t(len(image) + 1))
	if buf == nil {
		return 0, NewError(OpModuleLoadData, ErrorOutOfMemory)
	}
	defer C.free(buf)
	b := unsafe.Slice((*byte)(buf), len(image)+1)
	copy(b, image)
	b[len(image)] = 0
	var m C.uintptr_t
	if err := d.check(OpModuleLoadData, C.kvo_module_load(d.s.moduleLoadData, &m, buf)); err != nil {
		return 0, err
	}
	return Module(m), nil
}

func (d *libcuda) ModuleUnload(m Module) error {
	return d.check(OpModuleUnload, C.kvo_h(d.s.moduleUnload, C.uintptr_t(m)))
}

func (d *libcuda) ModuleGetFunction(m Module, name string) (Function, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var f C.uintptr_t
	if err := d.check(OpModuleGetFunction, C.kvo_get_function(d.s.moduleGetFunction, &f, C.uintptr_t(m), cname)); err != nil {
		return 0, err
	}
	return Function(f), nil
}

// LaunchKernel copies each parameter's bytes into one C allocation and
// builds the void** array there too; the driver copies the values at launch,
// so the memory is freed when the call returns.
func (d *libcuda) LaunchKernel(f Function, grid, block Dim3, sharedMem uint32, s Stream, args ...[]byte) error {
	const ptrSize = int(unsafe.Sizeof(uintptr(0)))
	total := len(args) * ptrSize
	for _, a := range args {
		total += (len(a) + 7) &^ 7
	}
	mem := C.calloc(C.size_t(max(total, 1)), 1)
	if mem == nil {
		return NewError(OpLaunchKernel, ErrorOutOfMemory)
	}
	defer C.free(mem)
	params := unsafe.Slice((*unsafe.Pointer)(mem), len(args))
	off := len(args) * ptrSize
	for i, a := range args {
		p := unsafe.Add(mem, off)
		copy(unsafe.Slice((*byte)(p), len(a)), a)
		params[i] = p
		off += (len(a) + 7) &^ 7
	}
	var pp *unsafe.Pointer
	if len(args) > 0 {
		pp = &params[0]
	}
	return d.check(OpLaunchKernel, C.kvo_launch(d.s.launchKernel, C.uintptr_t(f),
		C.uint(grid.X), C.uint(grid.Y), C.uint(grid.Z), C.uint(block.X), C.uint(block.Y), C.uint(block.Z),
		C.uint(sharedMem), C.uintptr_t(s), pp))
}

func (d *libcuda) GraphInstantiate(g Graph) (GraphExec, error) {
	var ge C.uintptr_t
	if err := d.check(OpGraphInstantiate, C.kvo_graph_instantiate(d.s.graphInstantiate, &ge, C.uintptr_t(g))); err != nil {
		return 0, err
	}
	return GraphExec(ge), nil
}

func (d *libcuda) GraphLaunch(ge GraphExec, s Stream) error {
	return d.check(OpGraphLaunch, C.kvo_h_h(d.s.graphLaunch, C.uintptr_t(ge), C.uintptr_t(s)))
}

func (d *libcuda) GraphDestroy(g Graph) error {
	return d.check(OpGraphDestroy, C.kvo_h(d.s.graphDestroy, C.uintptr_t(g)))
}

func (d *libcuda) GraphExecDestroy(ge GraphExec) error {
	return d.check(OpGraphExecDestroy, C.kvo_h(d.s.graphExecDestroy, C.uintptr_t(ge)))
}
