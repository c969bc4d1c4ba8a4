package register_test

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

// A registered region cannot be closed; Release unregisters and closes it.
func ExampleRelease() {
	r, err := mmapmem.New(1<<20, mmapmem.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	p := register.NewNone()
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
