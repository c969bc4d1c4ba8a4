//go:build cgo

package cuda_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

func TestLoadFromMissingLibrary(t *testing.T) {
	drv, err := cuda.LoadFrom("/nonexistent/libcuda.so.1")
	require.Nil(t, drv)
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	require.ErrorContains(t, err, "/nonexistent/libcuda.so.1")
}

func TestLoadFromLibraryWithoutDriverSymbols(t *testing.T) {
	drv, err := cuda.LoadFrom("libc.so.6")
	require.Nil(t, drv)
	require.ErrorIs(t, err, cuda.ErrNoDriver)
	require.ErrorContains(t, err, "does not export cuInit")
}
