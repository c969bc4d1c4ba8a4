// Package surface holds no code: its test keeps the module's shape, the
// rules of issue 53 that a change could quietly break. The public packages
// (Public) stay within their budgets of exported names, no exported
// identifier of a public package takes, returns or embeds a type of an
// internal package, `go doc -all ./offload` stays short enough to read,
// and no Go file outside tests nor Python file under python/ and bench/
// grows past MaxFileLines.
package surface

// Public lists the packages a user imports, relative to the module root.
var Public = []string{"offload", "offload/hostsim", "events", "metrics", "mmapmem", "register", "kvcache", "transfer", "bench"}

// Budgets of issue 53: exported names (top-level identifiers and methods;
// struct fields not counted) of offload, and of the other public packages
// together; the lines of `go doc -all ./offload`; the lines of one file.
const (
	MaxOffloadNames  = 150
	MaxOtherNames    = 250
	MaxOffloadDocAll = 600
	MaxFileLines     = 800
)
