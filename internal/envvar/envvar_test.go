package envvar

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestLookup(t *testing.T) {
	t.Setenv("KVOFFLOAD_ENVVAR_TEST", "os")
	require.Equal(t, "os", Get("KVOFFLOAD_ENVVAR_TEST"))
	SetLookup(func(name string) (string, bool) {
		if name == "KVOFFLOAD_ENVVAR_TEST" {
			return "host", true
		}
		return "", false
	})
	defer SetLookup(nil)
	v, ok := Lookup("KVOFFLOAD_ENVVAR_TEST")
	require.True(t, ok)
	require.Equal(t, "host", v)
	_, ok = Lookup("PATH")
	require.False(t, ok, "the replacement alone answers")
	SetLookup(nil)
	require.Equal(t, "os", Get("KVOFFLOAD_ENVVAR_TEST"))
}
