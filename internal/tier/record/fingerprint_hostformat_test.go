package record

import "testing"

// HostFormat 0 keeps the fingerprint of a geometry without it; any other
// value changes it.
func TestFingerprintHostFormat(t *testing.T) {
	g := Geometry{Namespace: []byte("m"), KVHeads: 8, Layers: 2, HeadDim: 128, DTypeBytes: 2, TokensPerBlock: 16, LayoutKind: 1, DType: "bf16"}
	base := Fingerprint(g)
	g.HostFormat = 0
	if Fingerprint(g) != base {
		t.Fatal("HostFormat 0 changed the fingerprint")
	}
	g.HostFormat = 1
	if Fingerprint(g) == base {
		t.Fatal("HostFormat 1 did not change the fingerprint")
	}
}
