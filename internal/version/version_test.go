package version

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// The version must be MAJOR.MINOR.PATCH: a Go module tag (after the v) and
// a PEP 440 version at once, with nothing to translate between them.
func TestVersionFormat(t *testing.T) {
	if !regexp.MustCompile(`^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$`).MatchString(Version) {
		t.Fatalf("VERSION %q is not MAJOR.MINOR.PATCH", Version)
	}
	if Tag() != "v"+Version {
		t.Fatalf("Tag() = %q", Tag())
	}
	b, err := os.ReadFile("VERSION")
	if err != nil {
		t.Fatal(err)
	}
	if string(b) != Version+"\n" {
		t.Fatalf("VERSION must hold the version and one newline, holds %q", b)
	}
}

// The Python package's __version__ in the source tree equals VERSION (the
// wheel builder writes it too; python/tests/test_version.py checks the
// installed copy).
func TestPythonVersionMatches(t *testing.T) {
	b, err := os.ReadFile("../../python/kvoffload/__init__.py")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^__version__ = "([^"]*)"$`).FindStringSubmatch(string(b))
	if m == nil {
		t.Fatal(`python/kvoffload/__init__.py has no line __version__ = "..."`)
	}
	if m[1] != Version {
		t.Fatalf("python/kvoffload/__init__.py: __version__ = %q, VERSION holds %q", m[1], Version)
	}
	if strings.Count(string(b), "__version__ = ") != 1 {
		t.Fatal("python/kvoffload/__init__.py sets __version__ more than once")
	}
}
