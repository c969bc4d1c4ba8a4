package register_test

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

// A registered region cannot be closed; Release unregisters and closes it.
// (The driver here is the fake of internal/cuda/cudafake, its context a
// register.Context through internal/cudadev.)
func ExampleRelease() {
	drv := cudafake.New(cudafake.Options{})
	defer drv.Close()
	ctx, err := drv.PrimaryCtxRetain(0)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer drv.PrimaryCtxRelease(0)
	p, err := register.NewCUDA(cudadev.Bind(drv, ctx), register.CUDAOptions{})
	if err != nil {
		fmt.Println(err)
		return
	}
	r, err := mmapmem.New(1<<20, mmapmem.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(p.Register(r))
	fmt.Println(p.Ranges(r))
	fmt.Println(errors.Is(r.Close(), mmapmem.ErrHeld))
	fmt.Println(register.Release(p, r))
	// Output:
	// <nil>
	// [{0 1048576}]
	// true
	// <nil>
}
