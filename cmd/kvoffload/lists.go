package main

import (
	"fmt"
	"strconv"
	"strings"
)

// sizeList is a flag.Value: comma-separated sizes with units.
type sizeList []int64

func (l *sizeList) String() string {
	parts := make([]string, len(*l))
	for i, n := range *l {
		parts[i] = formatSizeFlag(n)
	}
	return strings.Join(parts, ",")
}

func (l *sizeList) Set(s string) error {
	var out sizeList
	for _, p := range strings.Split(s, ",") {
		n, err := parseSize(p)
		if err != nil {
			return err
		}
		if n <= 0 {
			return fmt.Errorf("%w %q: must be positive", errSize, p)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// intList is a flag.Value: comma-separated positive integers.
type intList []int

func (l *intList) String() string {
	parts := make([]string, len(*l))
	for i, n := range *l {
		parts[i] = strconv.Itoa(n)
	}
	return strings.Join(parts, ",")
}

func (l *intList) Set(s string) error {
	var out intList
	for _, p := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(p))
		if err != nil || n < 1 {
			return fmt.Errorf("%q is not a positive integer", p)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// u64s converts between the list flags and the uint64 sizes bench takes.
func u64s[T int64 | uint64, U int64 | uint64](in []T) []U {
	out := make([]U, len(in))
	for i, v := range in {
		out[i] = U(v)
	}
	return out
}
