package main

import "strings"

// stringFlag is a flag.Value for a flag whose value is one of offload's
// string-typed Config enums; check and the engine validate it.
type stringFlag[T ~string] struct{ p *T }

func (f stringFlag[T]) String() string {
	if f.p == nil {
		return ""
	}
	return string(*f.p)
}

func (f stringFlag[T]) Set(s string) error {
	*f.p = T(s)
	return nil
}

// diskDirs splits --disk's DIR[,DIR] list.
func diskDirs(s string) []string {
	dirs := strings.Split(s, ",")
	for i := range dirs {
		dirs[i] = strings.TrimSpace(dirs[i])
	}
	return dirs
}
