// Package cgroup owns reading the process's cgroup memory accounting: which
// cgroups it belongs to (/proc/self/cgroup) and, for each such cgroup and
// every ancestor up to the hierarchy's root, the memory limit and usage.
//
// It reads cgroup v2 (memory.max, memory.current under /sys/fs/cgroup) and
// v1 (memory.limit_in_bytes, memory.usage_in_bytes under
// /sys/fs/cgroup/memory). It only reads, through a ReadFile the caller
// gives, so tests run it over a fake tree. It decides nothing: callers pick
// the level that binds them (smallest limit, smallest room left).
//
// Invariants: every listed Level had a readable, well-formed limit file;
// paths are absolute and slash-separated; the walk never leaves the
// cgroup mount (a ".." in /proc/self/cgroup is cleaned, and the walk stops
// at "/" at the latest).
package cgroup

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"path"
	"strconv"
	"strings"
)

// ReadFile returns the contents of the file at name, an absolute,
// slash-separated path such as "/proc/self/cgroup".
type ReadFile func(name string) ([]byte, error)

// Where the two hierarchies are mounted, and what each level holds.
const (
	v2Root      = "/sys/fs/cgroup"
	v1Root      = "/sys/fs/cgroup/memory"
	v2LimitFile = "memory.max"
	v2UsageFile = "memory.current"
	v1LimitFile = "memory.limit_in_bytes"
	v1UsageFile = "memory.usage_in_bytes"
)

// unlimitedFrom is where a numeric limit stops meaning anything: v1 writes
// "no limit" as PAGE_COUNTER_MAX pages in bytes (9223372036854771712 with
// 4 KiB pages), so a limit at or above 2^62 counts as unlimited.
const unlimitedFrom = math.MaxInt64 / 2

// Level is the memory accounting of one cgroup directory.
type Level struct {
	// Version is the cgroup version of the hierarchy: 1 or 2.
	Version int
	// LimitFile is the absolute path of the limit file read
	// ("/sys/fs/cgroup/a/memory.max").
	LimitFile string
	// Limit is the limit in bytes; meaningless when Unlimited.
	Limit int64
	// Unlimited is true when the limit file says "max" (v2) or holds v1's
	// no-limit sentinel.
	Unlimited bool
	// Usage is the memory charged to the cgroup in bytes, 0 when
	// UsageErr is set.
	Usage int64
	// UsageErr says why the usage file could not be read or parsed; nil
	// when Usage is known.
	UsageErr error
}

// Levels lists the memory accounting of the process's cgroups, in the
// order /proc/self/cgroup names them (v2's "0::" line and v1's memory
// controller line), each from the process's own cgroup up to the
// hierarchy's root. A directory whose limit file is missing or malformed
// is left out. The error, when /proc/self/cgroup cannot be read, wraps
// read's error; lines of it that name neither hierarchy are skipped.
func Levels(read ReadFile) ([]Level, error) {
	data, err := read("/proc/self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("cgroup: reading /proc/self/cgroup: %w", err)
	}
	var levels []Level
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "":
			levels = walk(levels, read, 2, path.Join(v2Root, parts[2]), v2LimitFile, v2UsageFile)
		case strings.Contains(","+parts[1]+",", ",memory,"):
			levels = walk(levels, read, 1, path.Join(v1Root, parts[2]), v1LimitFile, v1UsageFile)
		}
	}
	return levels, nil
}

// walk appends the levels of dir and its ancestors, stopping after either
// hierarchy's root or "/".
func walk(levels []Level, read ReadFile, version int, dir, limitFile, usageFile string) []Level {
	for d := dir; ; d = path.Dir(d) {
		if lv, ok := level(read, version, d, limitFile, usageFile); ok {
			levels = append(levels, lv)
		}
		if d == "/" || d == v2Root || d == v1Root {
			return levels
		}
	}
}

// level reads one directory; ok is false when its limit file is missing or
// malformed.
func level(read ReadFile, version int, dir, limitFile, usageFile string) (Level, bool) {
	lv := Level{Version: version, LimitFile: path.Join(dir, limitFile)}
	data, err := read(lv.LimitFile)
	if err != nil {
		return Level{}, false
	}
	switch s := strings.TrimSpace(string(data)); {
	case version == 2 && s == "max":
		lv.Unlimited = true
	default:
		n, err := parseBytes(s)
		if err != nil {
			return Level{}, false
		}
		lv.Limit, lv.Unlimited = n, n >= unlimitedFrom
	}
	usageName := path.Join(dir, usageFile)
	if data, err := read(usageName); err != nil {
		lv.UsageErr = err
	} else if lv.Usage, err = parseBytes(strings.TrimSpace(string(data))); err != nil {
		lv.UsageErr = fmt.Errorf("cgroup: %s: %w", usageName, err)
	}
	return lv, true
}

// parseBytes parses a non-negative decimal byte count.
func parseBytes(s string) (int64, error) {
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, err
	}
	if n < 0 {
		return 0, fmt.Errorf("byte count %d is negative", n)
	}
	return n, nil
}
