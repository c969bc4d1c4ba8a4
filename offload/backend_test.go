package offload

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
)

func TestSelectBackend(t *testing.T) {
	noDriver := func() (cuda.Driver, error) { return nil, cuda.ErrNoDriver }
	var fakes []*cudafake.Driver
	t.Cleanup(func() {
		for _, d := range fakes {
			_ = d.Close()
		}
	})
	fake := func() (cuda.Driver, error) {
		d := cudafake.New(cudafake.Options{})
		fakes = append(fakes, d)
		return d, nil
	}
	called := false
	spy := func() (cuda.Driver, error) { called = true; return nil, errors.New("must not load") }

	c, err := selectBackend(BackendHost, 0, loader(spy))
	require.NoError(t, err)
	require.Equal(t, BackendHost, c.name)
	require.False(t, called, "host backend never touches the driver")

	c, err = selectBackend(BackendAuto, 0, loader(noDriver))
	require.NoError(t, err)
	require.Equal(t, BackendHost, c.name)
	require.Contains(t, c.reason, "CUDA unavailable")

	_, err = selectBackend(BackendCUDA, 0, loader(noDriver))
	require.ErrorIs(t, err, ErrNoDriver)

	c, err = selectBackend(BackendAuto, 0, loader(fake))
	require.NoError(t, err)
	require.Equal(t, BackendCUDA, c.name)
	require.NotNil(t, c.drv)
	require.NotEmpty(t, c.busID)
	require.Contains(t, c.reason, c.busID)

	c, err = selectBackend(BackendAuto, 3, loader(fake))
	require.NoError(t, err)
	require.Equal(t, BackendHost, c.name)
	require.Contains(t, c.reason, "device 3 asked for, the driver sees 1")

	_, err = selectBackend(BackendCUDA, 3, loader(fake))
	require.ErrorIs(t, err, ErrNoDriver)
	require.ErrorContains(t, err, "device 3")
}
