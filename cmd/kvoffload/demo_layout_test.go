package main

import (
	"math"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
)

// TestGPUBlocksOverflow: a --gpu-blocks whose cache size would wrap an
// int64 (blocks × block bytes) is a usage error (exit 2) naming the value
// and the limit, for every preset; the largest count the limit allows
// passes the check and one more does not.
func TestGPUBlocksOverflow(t *testing.T) {
	for _, blocks := range []string{strconv.FormatInt(math.MaxInt64, 10), "4611686018427387904", "1152921504606846976"} {
		for _, layout := range []string{"tiny", "8b", "70b"} {
			code, out, errs := runCLI(t, "demo", "--backend", "host", "--layout", layout, "--gpu-blocks", blocks, "--requests", "1", "--duration", "0")
			require.Equal(t, exitUsage, code, "--layout %s --gpu-blocks %s: %s%s", layout, blocks, out, errs)
			require.Contains(t, errs, "--gpu-blocks "+blocks, layout)
			require.Contains(t, errs, "above the limit of 256 TiB", layout)
			require.NotRegexp(t, `(^|\s)-[0-9]`, errs+out, "no negative size")
		}
	}
	for _, layout := range []string{"tiny", "8b", "70b"} {
		lay := cacheLayout{shape: layoutPresets[layout], kind: offload.LayoutLayerSeparate}
		lay.blocks = int(maxSize / lay.blockBytes())
		require.NoError(t, checkLayout(lay), layout)
		require.LessOrEqual(t, lay.Bytes(), maxSize)
		lay.blocks++
		require.ErrorIs(t, checkLayout(lay), errUsage, layout)
	}
}
