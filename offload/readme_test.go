package offload

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// normalizeCode trims every line and drops blank ones, so that indentation
// (the README's code starts at column 0) does not matter.
func normalizeCode(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestREADMEGoBlocksRun: every Go block of the README is code that
// Example_readme runs (between its "README: begin/end" markers), so the
// README's serving loop is compiled and executed by go test.
func TestREADMEGoBlocksRun(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	example, err := os.ReadFile("example_test.go")
	require.NoError(t, err)
	var run []string
	for _, m := range regexp.MustCompile(`(?s)// README: begin \w+\n(.*?)// README: end`).FindAllStringSubmatch(string(example), -1) {
		// The README returns err where the example returns 0, err.
		run = append(run, normalizeCode(strings.ReplaceAll(m[1], "return 0, err", "return err")))
	}
	blocks := regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	require.NotEmpty(t, blocks)
	for _, b := range blocks {
		code := normalizeCode(b[1])
		found := false
		for _, r := range run {
			found = found || r == code
		}
		require.True(t, found, "README block not run by Example_readme:\n%s", code)
	}
}
