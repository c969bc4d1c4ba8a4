//go:build !cgo

package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

func TestLoadWithoutCgo(t *testing.T) {
	drv, err := cuda.Load()
	require.Nil(t, drv)
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	require.ErrorContains(t, err, "CGO_ENABLED=0")
}
