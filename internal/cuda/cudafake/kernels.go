package cudafake

import (
	"encoding/binary"
	"time"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// Kernel names the fake interprets (internal/cudacopy/kernels.cu).
const (
	KernelCopy     = "kvo_copy"
	KernelFill     = "kvo_fill"
	KernelChecksum = "kvo_checksum"
	// KernelCopySys is kvo_copy with a fence interval and a pace (which
	// change nothing the fake can observe).
	KernelCopySys = "kvo_copy_sys"
	// KernelCopyProbe is kvo_copy_sys throttled by read-backs instead of
	// fences (the same to the fake).
	KernelCopyProbe = "kvo_copy_probe"
	// KernelDesc2D is the marker kernel of an image whose copy kernels take
	// 2-D descriptors (aux != 0: rows in bits 48-63, the source pitch / 16
	// in bits 24-47, the destination pitch / 16 in bits 0-23, len the row's
	// bytes); the fake's copy kernels interpret them. It does nothing.
	KernelDesc2D = "kvo_desc2d"
	// KernelCopyTmpl is a template launch (kvo_copy_tmpl): the table holds
	// nt template pieces of 64 bytes {dev, stride, host_off, len, aux, 3
	// words unused}, then nb blocks of 16 bytes {host, id}; piece k of
	// block b copies len bytes (aux != 0: a 2-D descriptor's rows) between
	// host + host_off and dev + id × stride, host to device when h2d != 0.
	KernelCopyTmpl = "kvo_copy_tmpl"
	// KernelCopyTmplProbe is KernelCopyTmpl throttled by read-backs (the
	// same to the fake).
	KernelCopyTmplProbe = "kvo_copy_tmpl_probe"
)

// tmplPieceSize and tmplBlockSize are the sizes of a template launch's
// table entries (struct TDesc and TBlock in kernels.cu).
const (
	tmplPieceSize = 64
	tmplBlockSize = 16
)

// descSize is the size of one descriptor {src, dst, len, aux uint64}.
const descSize = 32

// kernelParams is each kernel's parameter sizes in bytes.
var kernelParams = map[string][]int{
	KernelCopy:      {8, 4},       // descs, n
	KernelFill:      {8, 4, 8},    // descs, n, spin_cycles
	KernelChecksum:  {8, 4, 8},    // descs, n, out
	KernelCopySys:   {8, 4, 8, 8}, // descs, n, fence_iters, pace_ns
	KernelCopyProbe: {8, 4, 8, 8}, // descs, n, fence_iters, pace_ns
	KernelDesc2D:    {},
	// table, nt, nb, h2d (and fence_iters, pace_ns)
	KernelCopyTmpl:      {8, 4, 4, 4},
	KernelCopyTmplProbe: {8, 4, 4, 4, 8, 8},
}

// maxSpin bounds the sleep that stands in for kvo_fill's spin.
const maxSpin = 20 * time.Millisecond

type module struct{ unloaded bool }

type function struct {
	name string
	mod  *module
}

// ModuleLoadData implements cuda.Driver: any non-empty image loads.
func (d *Driver) ModuleLoadData(image []byte) (cuda.Module, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpModuleLoadData, needCtx); err != nil {
		return 0, err
	}
	if len(image) == 0 {
		return 0, cuda.NewError(cuda.OpModuleLoadData, cuda.ErrorInvalidImage)
	}
	h := cuda.Module(d.handleLocked())
	d.modules[h] = &module{}
	return h, nil
}

// ModuleUnload implements cuda.Driver.
func (d *Driver) ModuleUnload(m cuda.Module) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpModuleUnload, needCtx); err != nil {
		return err
	}
	mod, ok := d.modules[m]
	if !ok {
		return cuda.NewError(cuda.OpModuleUnload, cuda.ErrorInvalidHandle)
	}
	mod.unloaded = true
	delete(d.modules, m)
	for h, f := range d.funcs {
		if f.mod == mod {
			delete(d.funcs, h)
		}
	}
	return nil
}

// ModuleGetFunction implements cuda.Driver for the kernels the fake knows
// (KernelCopy, KernelCopySys, KernelCopyProbe, KernelFill, KernelChecksum, KernelDesc2D); other names are
// CUDA_ERROR_NOT_FOUND.
func (d *Driver) ModuleGetFunction(m cuda.Module, name string) (cuda.Function, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, err := d.beginLocked(cuda.OpModuleGetFunction, needCtx); err != nil {
		return 0, err
	}
	mod, ok := d.modules[m]
	if !ok {
		return 0, cuda.NewError(cuda.OpModuleGetFunction, cuda.ErrorInvalidHandle)
	}
	if _, ok := kernelParams[name]; !ok {
		return 0, cuda.NewError(cuda.OpModuleGetFunction, cuda.ErrorNotFound)
	}
	h := cuda.Function(d.handleLocked())
	d.funcs[h] = &function{name: name, mod: mod}
	return h, nil
}

func validDim(x cuda.Dim3) bool { return x.X > 0 && x.Y > 0 && x.Z > 0 }

// LaunchKernel implements cuda.Driver. The parameters must have exactly the
// kernel's sizes, the grid and block must be non-empty and a block at most
// 1024 threads; otherwise CUDA_ERROR_INVALID_VALUE. Descriptors and the
// memory they name are read when the kernel runs: a bad address then is the
// sticky CUDA_ERROR_ILLEGAL_ADDRESS.
func (d *Driver) LaunchKernel(f cuda.Function, grid, block cuda.Dim3, sharedMem uint32, s cuda.Stream, args ...[]byte) error {
	const op = cuda.OpLaunchKernel
	d.mu.Lock()
	defer d.mu.Unlock()
	call, err := d.beginLocked(op, needCtx)
	if err != nil {
		return err
	}
	fn, ok := d.funcs[f]
	if !ok || fn.mod.unloaded {
		return cuda.NewError(op, cuda.ErrorInvalidHandle)
	}
	if !validDim(grid) || !validDim(block) || uint64(block.X)*uint64(block.Y)*uint64(block.Z) > 1024 {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	sizes := kernelParams[fn.name]
	if len(args) != len(sizes) {
		return cuda.NewError(op, cuda.ErrorInvalidValue)
	}
	copied := make([][]byte, len(args))
	for i, a := range args {
		if len(a) != sizes[i] {
			return cuda.NewError(op, cuda.ErrorInvalidValue)
		}
		copied[i] = append([]byte(nil), a...)
	}
	st, err := d.streamLocked(op, s)
	if err != nil {
		return err
	}
	return d.enqueueLocked(op, call, st, item{kind: itemKernel, fn: fn, args: copied})
}

// Mix64 is the kernels' mixing function (splitmix64's finaliser), for tests
// that check kvo_fill and kvo_checksum output.
func Mix64(x uint64) uint64 {
	x += 0x9E3779B97F4A7C15
	x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
	x = (x ^ (x >> 27)) * 0x94D049BB133111EB
	return x ^ (x >> 31)
}

type desc struct{ src, dst, len, aux uint64 }

// runKernel executes a launched kernel on the fake's memory.
func (d *Driver) runKernel(name string, args [][]byte) cuda.Result {
	if name == KernelDesc2D {
		return cuda.Success
	}
	if name == KernelCopyTmpl || name == KernelCopyTmplProbe {
		return d.runTemplate(args)
	}
	table := binary.LittleEndian.Uint64(args[0])
	n := uint64(binary.LittleEndian.Uint32(args[1]))
	if name == KernelFill {
		if spin := time.Duration(binary.LittleEndian.Uint64(args[2]) / 2); spin > 0 {
			time.Sleep(min(spin, maxSpin))
		}
	}
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	raw, ok := d.mem.slice(table, n*descSize)
	if !ok {
		return cuda.ErrorIllegalAddress
	}
	descs := make([]desc, n)
	for i := range descs {
		b := raw[i*descSize:]
		descs[i] = desc{
			src: binary.LittleEndian.Uint64(b[0:]),
			dst: binary.LittleEndian.Uint64(b[8:]),
			len: binary.LittleEndian.Uint64(b[16:]),
			aux: binary.LittleEndian.Uint64(b[24:]),
		}
	}
	for i, ds := range descs {
		switch name {
		case KernelCopy, KernelCopySys, KernelCopyProbe:
			if !d.copyDesc(ds) {
				return cuda.ErrorIllegalAddress
			}
		case KernelFill:
			words := ds.len >> 3
			dst, ok := d.mem.slice(ds.dst, words*8)
			if !ok {
				return cuda.ErrorIllegalAddress
			}
			for w := range words {
				binary.LittleEndian.PutUint64(dst[w*8:], Mix64(ds.aux+w))
			}
		case KernelChecksum:
			out := binary.LittleEndian.Uint64(args[2])
			words := ds.len >> 3
			src, ok1 := d.mem.slice(ds.src, words*8)
			dst, ok2 := d.mem.slice(out+uint64(i)*8, 8)
			if !ok1 || !ok2 {
				return cuda.ErrorIllegalAddress
			}
			binary.LittleEndian.PutUint64(dst, Checksum(src))
		}
	}
	return cuda.Success
}

// runTemplate runs a template launch (KernelCopyTmpl): every block's
// pieces, block by block.
func (d *Driver) runTemplate(args [][]byte) cuda.Result {
	table := binary.LittleEndian.Uint64(args[0])
	nt := uint64(binary.LittleEndian.Uint32(args[1]))
	nb := uint64(binary.LittleEndian.Uint32(args[2]))
	h2d := binary.LittleEndian.Uint32(args[3]) != 0
	d.mem.mu.RLock()
	defer d.mem.mu.RUnlock()
	raw, ok := d.mem.slice(table, nt*tmplPieceSize+nb*tmplBlockSize)
	if !ok {
		return cuda.ErrorIllegalAddress
	}
	u := func(off uint64) uint64 { return binary.LittleEndian.Uint64(raw[off:]) }
	for b := range nb {
		bo := nt*tmplPieceSize + b*tmplBlockSize
		host, id := u(bo), u(bo+8)
		for k := range nt {
			po := k * tmplPieceSize
			h, v := host+u(po+16), u(po)+id*u(po+8)
			ds := desc{src: v, dst: h, len: u(po + 24), aux: u(po + 32)}
			if h2d {
				ds.src, ds.dst = h, v
			}
			if !d.copyDesc(ds) {
				return cuda.ErrorIllegalAddress
			}
		}
	}
	return cuda.Success
}

// copyDesc runs one copy descriptor (2-D when aux is set), as kvo_copy's
// warps do; false when a span is outside device or host memory. The caller
// holds d.mem.mu.
func (d *Driver) copyDesc(ds desc) bool {
	if ds.aux != 0 {
		return d.copy2D(ds)
	}
	dst, ok1 := d.mem.slice(ds.dst, ds.len)
	src, ok2 := d.mem.slice(ds.src, ds.len)
	if !ok1 || !ok2 {
		return false
	}
	copy(dst, src)
	return true
}

// Checksum is kvo_checksum's function of one segment: the wrapping sum over
// its 8-byte little-endian words w[i] of Mix64(w[i] ^ (i * 0x9E3779B97F4A7C15)).
// Trailing bytes beyond a multiple of 8 are ignored, as the kernel does.
func Checksum(b []byte) uint64 {
	var sum uint64
	for i := uint64(0); (i+1)*8 <= uint64(len(b)); i++ {
		sum += Mix64(binary.LittleEndian.Uint64(b[i*8:]) ^ (i * 0x9E3779B97F4A7C15))
	}
	return sum
}

// copy2D runs one 2-D copy descriptor (see KernelDesc2D); false on a bad
// address.
func (d *Driver) copy2D(ds desc) bool {
	rows := ds.aux >> 48
	sp, dp := (ds.aux>>24&0xFFFFFF)*16, (ds.aux&0xFFFFFF)*16
	for r := range rows {
		dst, ok1 := d.mem.slice(ds.dst+r*dp, ds.len)
		src, ok2 := d.mem.slice(ds.src+r*sp, ds.len)
		if !ok1 || !ok2 {
			return false
		}
		copy(dst, src)
	}
	return true
}
