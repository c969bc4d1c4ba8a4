package offload

import (
	"fmt"
	"slices"
	"strings"
)

// The values of the enumerated types (each type says what they mean).
const (
	BackendAuto, BackendCUDA, BackendHost            Backend     = "auto", "cuda", "host"
	PinNone, PinMlock                                HostPinning = "none", "mlock"
	HugePagesTHP, HugePagesNone, HugePagesHugeTLB    HugePages   = "thp", "none", "hugetlb"
	PolicyTinyLFU, PolicyLRU                         Policy      = "tinylfu", "lru"
	LayoutLayerSeparate, LayoutCrossLayer, LayoutMLA LayoutKind  = "layer-separate", "cross-layer", "mla"
	OrderTokenMajor, OrderHeadMajor                  HeadOrder   = "token-major", "head-major"
	EventStored, EventRemoved, EventCleared          EventKind   = 1, 2, 3
	DiskFsyncNone, DiskFsyncEach, DiskFsyncOnClose   DiskFsync   = "none", "each", "on-close"
	DiskDirectAuto, DiskDirectRequire, DiskDirectOff DiskDirect  = "auto", "require", "off"
	DefaultWriteBackBytes                            int64       = 64 << 20
	MediumCPU, MediumDisk, MediumSharedStorage                   = "CPU", "DISK", "SHARED_STORAGE"
)

// The Config enums unmarshal from JSON (and any text) as their constants'
// strings; "" means the field's default, and anything else is refused with
// ErrInvalidConfig naming the value and the accepted ones. withDefaults
// checks them again for values set in Go.

var (
	backends    = []Backend{BackendAuto, BackendCUDA, BackendHost}
	pinnings    = []HostPinning{PinNone, PinMlock}
	hugePages   = []HugePages{HugePagesTHP, HugePagesNone, HugePagesHugeTLB}
	policies    = []Policy{PolicyTinyLFU, PolicyLRU}
	layoutKinds = []LayoutKind{LayoutLayerSeparate, LayoutCrossLayer, LayoutMLA}
	headOrders  = []HeadOrder{"", OrderTokenMajor, OrderHeadMajor}
	diskFsyncs  = []DiskFsync{DiskFsyncNone, DiskFsyncEach, DiskFsyncOnClose}
	diskDirects = []DiskDirect{DiskDirectAuto, DiskDirectRequire, DiskDirectOff}
)

// UnmarshalText implements encoding.TextUnmarshaler: a known policy or "".
func (f *DiskFsync) UnmarshalText(text []byte) error {
	return parseEnum(f, text, "Disk.Fsync", diskFsyncs)
}

// UnmarshalText implements encoding.TextUnmarshaler: a known mode or "".
func (d *DiskDirect) UnmarshalText(text []byte) error {
	return parseEnum(d, text, "Disk.Direct", diskDirects)
}

// UnmarshalText implements encoding.TextUnmarshaler: a known backend or "".
func (b *Backend) UnmarshalText(text []byte) error { return parseEnum(b, text, "Backend", backends) }

// UnmarshalText implements encoding.TextUnmarshaler: a known mode or "".
func (p *HostPinning) UnmarshalText(text []byte) error {
	return parseEnum(p, text, "HostPinning", pinnings)
}

// UnmarshalText implements encoding.TextUnmarshaler: a known mode or "".
func (h *HugePages) UnmarshalText(text []byte) error {
	return parseEnum(h, text, "HugePages", hugePages)
}

// UnmarshalText implements encoding.TextUnmarshaler: a known policy or "".
func (p *Policy) UnmarshalText(text []byte) error { return parseEnum(p, text, "Policy", policies) }

// UnmarshalText implements encoding.TextUnmarshaler: a known kind.
func (k *LayoutKind) UnmarshalText(text []byte) error {
	return parseEnum(k, text, "Layout.Kind", layoutKinds)
}

// UnmarshalText implements encoding.TextUnmarshaler: a known order or "".
func (o *HeadOrder) UnmarshalText(text []byte) error {
	return parseEnum(o, text, "Layout.Order", headOrders)
}

// parseEnum sets *dst to text if it is "" or one of valid.
func parseEnum[T ~string](dst *T, text []byte, field string, valid []T) error {
	v := T(text)
	if v != "" {
		if err := checkEnum(field, v, valid); err != nil {
			return err
		}
	}
	*dst = v
	return nil
}

// checkEnum refuses a value not among valid (ErrInvalidConfig).
func checkEnum[T ~string](field string, v T, valid []T) error {
	if slices.Contains(valid, v) {
		return nil
	}
	return fmt.Errorf("%w: %s %q: must be %s", ErrInvalidConfig, field, string(v), quoteList(valid))
}

// quoteList is `"a", "b" or "c"`.
func quoteList[T ~string](vs []T) string {
	q := make([]string, len(vs))
	for i, v := range vs {
		q[i] = fmt.Sprintf("%q", string(v))
	}
	if len(q) == 1 {
		return q[0]
	}
	return strings.Join(q[:len(q)-1], ", ") + " or " + q[len(q)-1]
}
