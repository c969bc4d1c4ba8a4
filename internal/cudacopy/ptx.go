package cudacopy

import (
	"embed"
	"fmt"
	"io/fs"
)

// kernelFiles holds kernels.cu and, once `make ptx` has generated it,
// kernels.ptx. The pattern matches the source too, so the package builds
// before the PTX exists; PTX reports its absence as ErrUnavailable.
//
//go:embed kernels.*
var kernelFiles embed.FS

// PTX returns the embedded PTX image of kernels.cu (kvo_copy, kvo_fill,
// kvo_checksum and kvo_sgemm), for cuModuleLoadData. It wraps ErrUnavailable
// when the binary was built without kernels.ptx or with an empty one.
func PTX() ([]byte, error) {
	b, err := fs.ReadFile(kernelFiles, "kernels.ptx")
	if err != nil || len(b) == 0 {
		return nil, fmt.Errorf("%w: no kernels.ptx embedded (run `make ptx` on a machine with nvcc and rebuild)", ErrUnavailable)
	}
	return b, nil
}
