package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestSysfsBusID(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:19:00.0": "0000:19:00.0",
		"0000:0A:00.0":     "0000:0a:00.0",
		"0000:AA:00.0":     "0000:aa:00.0",
		"1:00:06.0":        "0001:00:06.0",
		"1:02:00.0":        "0001:02:00.0",
		" weird ":          "weird",
	} {
		require.Equal(t, want, SysfsBusID(in), in)
	}
}
