// Package version is kvoffload's release version, the one source of it:
// the file VERSION beside this one. `kvoffload version`, the library's
// kvo_version(), the Python package's __version__, the wheel's version
// (make wheel) and the module's release tag v<VERSION> (make release-tag)
// all come from it.
//
// The C ABI version (KVO_ABI_VERSION in capi/kvoffload.h) is separate: it
// changes only on an incompatible change of the C ABI.
package version

import (
	_ "embed"
	"runtime/debug"
	"strings"
)

//go:embed VERSION
var raw string

// Version is the release version, MAJOR.MINOR.PATCH (valid both as a Go
// module tag without its v and as a Python package version).
var Version = strings.TrimSpace(raw)

// Tag is the module's release tag for Version.
func Tag() string { return "v" + Version }

// commit is set by the Makefile's builds (-ldflags -X), for builds
// without VCS stamping (-buildvcs=false).
var commit string

// Commit returns the VCS revision the binary was built from, with
// "-dirty" when the tree had changes: Go's VCS stamp, else what the
// Makefile set with -ldflags -X, else "" (go test, go run, a build outside
// the repository).
func Commit() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return commit
	}
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value
		}
	}
	if rev == "" {
		return commit
	}
	if modified == "true" {
		rev += "-dirty"
	}
	return rev
}
