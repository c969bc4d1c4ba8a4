package mmapmem

import (
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// TestOpenMemfd: a memfd region mapped a second time through its fd (as a
// node pool's client maps a received one) shares the bytes, prefaulting
// changes nothing, and a file too short for the size asked is refused with
// the fd left open.
func TestOpenMemfd(t *testing.T) {
	r, err := New(3<<20, Options{Memfd: true, PrefaultThreads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	b := r.Bytes()
	for i := range b {
		b[i] = byte(i * 7)
	}
	fd, err := unix.Dup(r.Fd())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := OpenMemfd(fd, 64<<20, Options{}); !errors.Is(err, errSize) {
		t.Fatalf("oversized open: %v", err)
	}
	o, err := OpenMemfd(fd, r.Len(), Options{PrefaultThreads: 2})
	if err != nil {
		_ = unix.Close(fd)
		t.Fatal(err)
	}
	ob := o.Bytes()
	for i := range ob {
		if ob[i] != byte(i*7) {
			t.Fatalf("byte %d: %d", i, ob[i])
		}
	}
	ob[5] = 99
	if b[5] != 99 {
		t.Fatal("the second mapping does not share the memory")
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Close(fd); !errors.Is(err, unix.EBADF) {
		t.Fatalf("Close left the fd open: %v", err)
	}
}
