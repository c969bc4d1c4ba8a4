package metrics_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCoreDoesNotImportViews checks that offload (and what it imports) does
// not depend on the metrics and events views nor their libraries: a Go
// stack that embeds the engine without them does not get them.
func TestCoreDoesNotImportViews(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/kvoffload/kvoffload/offload").CombinedOutput()
	if err != nil {
		t.Skipf("go list: %v: %s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"github.com/kvoffload/kvoffload/metrics", "github.com/kvoffload/kvoffload/events",
			"github.com/prometheus/", "github.com/go-zeromq/", "github.com/vmihailenco/"} {
			if strings.HasPrefix(dep, banned) {
				t.Errorf("offload depends on %s", dep)
			}
		}
	}
}
