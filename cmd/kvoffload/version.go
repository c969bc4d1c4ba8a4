package main

import (
	"context"
	"flag"
	"fmt"
	"runtime"

	"github.com/kvoffload/kvoffload/internal/version"
)

var versionCommand = command{
	name:    "version",
	summary: "Print kvoffload's release version, the commit it was built from and the Go toolchain.",
	details: `The release version is internal/version/VERSION, the same as the Python
package's kvoffload.__version__, the library's kvo_version() and the wheel's
version; the module is tagged v<version>.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		asJSON := fs.Bool("json", false, "print the version as one JSON object")
		return func(_ context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			v := currentVersion()
			if *asJSON {
				return writeJSON(e.stdout, v)
			}
			commit := v.Commit
			if commit == "" {
				commit = "unknown"
			}
			_, err := fmt.Fprintf(e.stdout, "kvoffload %s (commit %s, %s, %s/%s)\n", v.Version, commit, v.Go, v.OS, v.Arch)
			return err
		}
	},
}

// versionInfo is what version reports.
type versionInfo struct {
	Version string `json:"version"`
	// Commit is the VCS revision of the build ("-dirty" when the tree had
	// changes); empty when the build recorded none.
	Commit string `json:"commit,omitempty"`
	Go     string `json:"go"`
	OS     string `json:"os"`
	Arch   string `json:"arch"`
}

func currentVersion() versionInfo {
	return versionInfo{Version: version.Version, Commit: version.Commit(), Go: runtime.Version(), OS: runtime.GOOS, Arch: runtime.GOARCH}
}
