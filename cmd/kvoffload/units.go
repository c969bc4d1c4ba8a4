package main

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// errSize is wrapped by every size-parsing error.
var errSize = errors.New("invalid size")

// sizeUnits maps a unit suffix (lower case) to its multiplier. Binary units
// (KiB, MiB...) and their one-letter forms (K, M, G, T) are powers of 1024;
// KB, MB, GB, TB are powers of 1000, as on a disk label.
var sizeUnits = map[string]float64{
	"": 1, "b": 1,
	"k": 1 << 10, "kib": 1 << 10, "kb": 1e3,
	"m": 1 << 20, "mib": 1 << 20, "mb": 1e6,
	"g": 1 << 30, "gib": 1 << 30, "gb": 1e9,
	"t": 1 << 40, "tib": 1 << 40, "tb": 1e12,
}

// maxSize bounds a parsed size (256 TiB): beyond it nothing this program
// sizes makes sense, and the bound keeps every product below int64 overflow.
const maxSize int64 = 1 << 48

// parseSize parses a byte size such as "4096", "64KiB", "1.5GiB", "2G" or
// "100GB". A fraction must come out as a whole number of bytes.
func parseSize(s string) (int64, error) {
	t := strings.TrimSpace(s)
	if strings.HasPrefix(t, "-") {
		return 0, fmt.Errorf("%w %q: negative; a size is 0 to %s", errSize, s, formatSize(maxSize))
	}
	i := strings.IndexFunc(t, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	num, unit := t, ""
	if i >= 0 {
		num, unit = t[:i], strings.TrimSpace(t[i:])
	}
	mult, ok := sizeUnits[strings.ToLower(unit)]
	if !ok {
		return 0, fmt.Errorf("%w %q: unknown unit %q (use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB or TB)", errSize, s, unit)
	}
	if num == "" {
		return 0, fmt.Errorf("%w %q: no number", errSize, s)
	}
	if !strings.Contains(num, ".") {
		n, err := strconv.ParseInt(num, 10, 64)
		if err != nil || n > maxSize || float64(n)*mult > float64(maxSize) {
			return 0, fmt.Errorf("%w %q: not a number of bytes up to %s", errSize, s, formatSize(maxSize))
		}
		return n * int64(mult), nil
	}
	f, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, fmt.Errorf("%w %q: %q is not a number", errSize, s, num)
	}
	v := f * mult
	if v > float64(maxSize) {
		return 0, fmt.Errorf("%w %q: above the limit of %s", errSize, s, formatSize(maxSize))
	}
	if v != math.Trunc(v) {
		return 0, fmt.Errorf("%w %q: %g bytes is not a whole number", errSize, s, v)
	}
	return int64(v), nil
}

// formatSize renders n bytes with the largest binary unit that keeps the
// number at least 1, to three significant digits: "1 GiB", "1.5 MiB", "512 B".
func formatSize(n int64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	v := float64(n)
	u := 0
	for math.Abs(v) >= 1024 && u < len(units)-1 {
		v /= 1024
		u++
	}
	prec := 0
	switch a := math.Abs(v); {
	case u == 0 || a >= 100:
	case a >= 10:
		prec = 1
	default:
		prec = 2
	}
	s := strconv.FormatFloat(v, 'f', prec, 64)
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s + " " + units[u]
}

// sizeFlag is a flag.Value holding a byte size given with units.
type sizeFlag struct{ n *int64 }

func (f sizeFlag) String() string {
	if f.n == nil {
		return "0"
	}
	return formatSizeFlag(*f.n)
}

func (f sizeFlag) Set(s string) error {
	n, err := parseSize(s)
	if err != nil {
		return err
	}
	*f.n = n
	return nil
}

// formatSizeFlag renders a size the way a user would type it back
// ("1GiB", "512MiB", "4096").
func formatSizeFlag(n int64) string {
	for _, u := range []struct {
		name string
		v    int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.v == 0 {
			return strconv.FormatInt(n/u.v, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10)
}
