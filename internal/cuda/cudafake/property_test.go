package cudafake_test

import (
	"bytes"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

// TestMemoryModel drives random allocations, frees, registrations and
// copies against a model: copies inside known memory land byte-exact,
// copies outside are refused, and Live matches what the model holds.
func TestMemoryModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		const capacity = 1 << 16
		d := cudafake.New(cudafake.Options{DeviceMemory: capacity})
		defer func() { require.NoError(rt, d.Close()) }()
		host, err := unix.Mmap(-1, 0, 8*4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
		require.NoError(rt, err)
		defer func() { require.NoError(rt, unix.Munmap(host)) }()

		type buf struct {
			ptr  cuda.DevicePtr
			data []byte // the model's copy of its contents
		}
		var dev []buf
		registered := map[int]buf{} // page index → registration of one page
		var devBytes uint64
		all := func() []buf {
			out := append([]buf(nil), dev...)
			for _, b := range registered {
				out = append(out, b)
			}
			return out
		}
		pick := func(rt *rapid.T, label string) (buf, bool) {
			bs := all()
			if len(bs) == 0 {
				return buf{}, false
			}
			return bs[rapid.IntRange(0, len(bs)-1).Draw(rt, label)], true
		}
		rt.Repeat(map[string]func(*rapid.T){
			"alloc": func(rt *rapid.T) {
				n := rapid.Uint64Range(1, capacity/4).Draw(rt, "n")
				p, err := d.MemAlloc(n)
				if devBytes+n > capacity {
					require.True(rt, cuda.IsCode(err, cuda.ErrorOutOfMemory), "%v", err)
					return
				}
				require.NoError(rt, err)
				dev = append(dev, buf{p, make([]byte, n)})
				devBytes += n
			},
			"free": func(rt *rapid.T) {
				if len(dev) == 0 {
					return
				}
				i := rapid.IntRange(0, len(dev)-1).Draw(rt, "i")
				require.NoError(rt, d.MemFree(dev[i].ptr))
				devBytes -= uint64(len(dev[i].data))
				dev = append(dev[:i], dev[i+1:]...)
			},
			"register": func(rt *rapid.T) {
				page := rapid.IntRange(0, 7).Draw(rt, "page")
				p := unsafe.Pointer(&host[page*4096])
				err := d.MemHostRegister(p, 4096, 0)
				if _, ok := registered[page]; ok {
					require.True(rt, cuda.IsCode(err, cuda.ErrorHostMemoryAlreadyRegistered), "%v", err)
					return
				}
				require.NoError(rt, err)
				clear(host[page*4096 : (page+1)*4096])
				registered[page] = buf{cuda.DevicePtr(uintptr(p)), host[page*4096 : (page+1)*4096]}
			},
			"unregister": func(rt *rapid.T) {
				page := rapid.IntRange(0, 7).Draw(rt, "page")
				err := d.MemHostUnregister(unsafe.Pointer(&host[page*4096]))
				if _, ok := registered[page]; !ok {
					require.True(rt, cuda.IsCode(err, cuda.ErrorHostMemoryNotRegistered), "%v", err)
					return
				}
				require.NoError(rt, err)
				delete(registered, page)
			},
			"copy": func(rt *rapid.T) {
				src, ok1 := pick(rt, "src")
				dst, ok2 := pick(rt, "dst")
				if !ok1 || !ok2 {
					return
				}
				n := rapid.IntRange(1, min(len(src.data), len(dst.data))+1).Draw(rt, "n")
				err := d.Memcpy(dst.ptr, src.ptr, uint64(n))
				if n > len(src.data) || n > len(dst.data) {
					require.True(rt, cuda.IsCode(err, cuda.ErrorInvalidValue), "%v", err)
					return
				}
				require.NoError(rt, err)
				copy(dst.data, src.data[:n])
			},
			"fill": func(rt *rapid.T) {
				b, ok := pick(rt, "buf")
				if !ok {
					return
				}
				v := rapid.Byte().Draw(rt, "v")
				require.NoError(rt, d.MemsetD8(b.ptr, v, uint64(len(b.data))))
				for i := range b.data {
					b.data[i] = v
				}
			},
		})
		// Read every device buffer back through a registered page (whose
		// model is the host memory itself).
		for _, r := range registered {
			for _, b := range dev {
				n := min(len(b.data), len(r.data))
				require.NoError(rt, d.Memcpy(r.ptr, b.ptr, uint64(n)))
				require.True(rt, bytes.Equal(b.data[:n], r.data[:n]))
			}
			break
		}
		live := d.Live()
		require.Equal(rt, len(dev), live.DeviceAllocs)
		require.Equal(rt, devBytes, live.DeviceBytes)
		require.Equal(rt, len(registered), live.Registrations)
	})
}
