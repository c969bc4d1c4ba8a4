package mmapmem

import "testing"

// MappedBytes is the number of bytes this package holds mapped right now.
func MappedBytes() int64 { return mappedBytes.Load() }

// ForceTouchPrefault makes prefaulting take the touch-one-byte-per-page path
// for the rest of the test.
func ForceTouchPrefault(t *testing.T) {
	prev := populateUnsupported.Load()
	populateUnsupported.Store(true)
	t.Cleanup(func() { populateUnsupported.Store(prev) })
}
