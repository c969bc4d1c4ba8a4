package nodepool

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/internal/tiered"
)

// TestNodeDiskOtherLayoutKept: a node whose disk directory holds the
// records of another layout (another slot size, written by an embedded
// engine of another model, say) keeps that file as it is, beside its own;
// with tiered.DiskConfig.RemoveRecords naming it, the node removes it.
func TestNodeDiskOtherLayoutKept(t *testing.T) {
	dir := t.TempDir()
	const otherPayload = 3 * testSlot // not the node's slot size
	other := disk.Config{Dirs: []string{dir}, CapacityBytes: 8 * disk.SlotBytes(otherPayload), RecordPayloadBytes: otherPayload, Fingerprint: 42}
	st, err := disk.Open(other)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte{0x5a}, otherPayload)
	if err := st.Put([16]byte{1}, payload); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	otherName := fmt.Sprintf("records-%d.kvo", disk.SlotBytes(otherPayload))
	before, err := os.ReadFile(filepath.Join(dir, otherName))
	if err != nil {
		t.Fatal(err)
	}

	run := func(dc *tiered.DiskConfig) {
		s := startServer(t, ServerConfig{PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, Disk: dc})
		c := dialMapped(t, s)
		storeOneBlock(t, c, testKeys(3, 1)[0], Key{})
		// Written through on the first run, found at open on the second.
		waitStats(t, s, "write-through", func(st Stats) bool { return st.DiskRecords == 1 })
		if st := s.Stats(); st.DiskError != "" {
			t.Fatalf("the node's tier is off: %s", st.DiskError)
		}
		c.Close()
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	run(&tiered.DiskConfig{Dirs: []string{dir}, CapacityBytes: 1 << 20, WriteThrough: true})
	after, err := os.ReadFile(filepath.Join(dir, otherName))
	if err != nil || !bytes.Equal(before, after) {
		t.Fatalf("the other layout's records file after a node ran on its directory: %v (unchanged: %v)", err, bytes.Equal(before, after))
	}
	st, err = disk.Open(other)
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, otherPayload)
	if ok, err := st.Get([16]byte{1}, got); !ok || err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("the other layout's record: found %v, %v", ok, err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}

	run(&tiered.DiskConfig{Dirs: []string{dir}, CapacityBytes: 1 << 20, WriteThrough: true, RemoveRecords: []string{otherName}})
	if _, err := os.Stat(filepath.Join(dir, otherName)); !os.IsNotExist(err) {
		t.Fatalf("RemoveRecords %s: the file is still there (%v)", otherName, err)
	}
}
