package mmapmem_test

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// A region is exactly the size asked for; only its mapping is rounded, to
// the page size.
func ExampleNew() {
	r, err := mmapmem.New(10_000, mmapmem.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(r.Len(), len(r.Bytes()), r.Mapped()%r.PageSize() == 0, r.Mapped()-r.Len() < r.PageSize())
	fmt.Println(r.Close())
	fmt.Println(errors.Is(r.Close(), mmapmem.ErrClosed))
	// Output:
	// 10000 10000 true true
	// <nil>
	// true
}
