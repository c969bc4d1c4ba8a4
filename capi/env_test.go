//go:build cgo

package main

import (
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/envvar"
)

// The engine's switches are read from the process's current environment:
// a variable a host set, changed or removed behind Go's copy is seen as
// the host left it, and Go's copy is not written.
func TestEnvFromHost(t *testing.T) {
	const a, b = "KVOFFLOAD_ENV_TEST_A", "KVOFFLOAD_ENV_TEST_B"
	t.Cleanup(func() {
		unsetenvC(a)
		unsetenvC(b)
	})
	t.Setenv(b, "old") // in both copies
	setenvC(a, "1")
	unsetenvC(b)
	_, ok := os.LookupEnv(a)
	require.False(t, ok, "Go's copy sees a host's setenv: the test proves nothing")
	require.Equal(t, "old", os.Getenv(b))

	require.Equal(t, "1", envvar.Get(a))
	_, ok = envvar.Lookup(b)
	require.False(t, ok, "removed by the host: unset")
	setenvC(a, "2")
	require.Equal(t, "2", envvar.Get(a))
	_, ok = os.LookupEnv(a)
	require.False(t, ok, "Go's copy was written")
}
