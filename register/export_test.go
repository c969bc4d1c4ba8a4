package register

import (
	"testing"

	"github.com/kvoffload/kvoffload/mmapmem"
)

// SetPrefault replaces the prefault of deferred regions' ranges for the
// rest of the test (f gets the region, offset and length).
func SetPrefault(t *testing.T, f func(r *mmapmem.Region, off, n int64) error) {
	prev := prefaultRange
	prefaultRange = f
	t.Cleanup(func() { prefaultRange = prev })
}

// MaxRangeSize is the default and largest CUDA registration range.
const MaxRangeSize = maxRangeSize

// RangeError is the error of a failed registration of one range.
type RangeError = rangeError
