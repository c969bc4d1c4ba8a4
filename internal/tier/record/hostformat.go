package record

import "fmt"

// HostFormat is the layout of the bytes of a kvcache slot, and so of a
// record's payload (which is the slot): what a reader of another process or
// tensor-parallel size must agree on besides the geometry.
// Geometry.HostFormat carries it (as a uint8) into the fingerprint.
type HostFormat uint8

// Host formats.
const (
	// HostDeviceOrder: each segment of the slot is a byte copy of the
	// device's segment, in the device's order (kvcache layouts of
	// undeclared order, LayoutSpec.Order zero). Only engines of the same
	// device order and TP size share it.
	HostDeviceOrder HostFormat = iota
	// HostHeadMajor: per layer, K then V (K only for MLA), each holding
	// every KV head of the model, head by head, each head's tokens ×
	// head_dim contiguous; a layer's K (or V) starts at a multiple of 16
	// bytes for layer-separate and MLA layouts and right after the
	// previous one for cross-layer layouts (kvcache layouts of declared
	// order). The same bytes for every TP size and device order.
	HostHeadMajor
)

func (f HostFormat) String() string {
	switch f {
	case HostDeviceOrder:
		return "device-order"
	case HostHeadMajor:
		return "head-major"
	}
	return fmt.Sprintf("HostFormat(%d)", uint8(f))
}
