package main

import (
	"encoding/json"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/version"
)

func TestVersion(t *testing.T) {
	for _, args := range [][]string{{"version"}, {"--version"}} {
		code, out, errs := runCLI(t, args...)
		require.Equal(t, exitOK, code, errs)
		require.Empty(t, errs)
		require.True(t, strings.HasPrefix(out, "kvoffload "+version.Version+" (commit "), out)
		require.Contains(t, out, runtime.Version())
	}

	code, out, errs := runCLI(t, "version", "--json")
	require.Equal(t, exitOK, code, errs)
	var v versionInfo
	require.NoError(t, json.Unmarshal([]byte(out), &v), out)
	require.Equal(t, version.Version, v.Version)
	require.Equal(t, runtime.GOOS, v.OS)
	require.Equal(t, runtime.GOARCH, v.Arch)

	code, _, errs = runCLI(t, "version", "extra")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errs, "unexpected argument")
}
