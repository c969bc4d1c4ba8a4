//go:build !cgo

package cuda

import "fmt"

// Load returns ErrNoDriver: this build has no cgo, so libcuda cannot be
// loaded and only the host backend exists.
func Load() (Driver, error) {
	return nil, fmt.Errorf("%w: built with CGO_ENABLED=0", ErrNoDriver)
}
