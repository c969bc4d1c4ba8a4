package disk

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/internal/tier/record"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// q1Method is one way of reading every record of a store's file in slot
// order, one read in flight (diagnoseQ1).
type q1Method struct {
	name string
	// pass reads records 0..n-1 and returns each record's time and the
	// time spent in its preads (0 where it cannot be told).
	pass func() (total, io []time.Duration, gbs float64)
}

// diagnoseQ1 is TestDiskVsFio's Q=1 diagnosis (KVO_DISK_BENCH_Q1DIAG=1):
// one store written in slot order by Put, then read back whole, in slot
// order, one record at a time, by fio (psync, --rw=read, on the store's own
// file), by a plain Go pread loop into one buffer (what fio does), by
// preadv of the header and payload into the store's two buffers, by that
// with the payload's CRC after it, and by Get (split and in one read).
// Every method reads the same records of the same file in the same order;
// each round starts one method later. It returns a Markdown section: per
// method the median pass, per record the time and the time in preads, and
// the block device's read requests per record (from its stat file).
func diagnoseQ1(t *testing.T, fio, work string, records int64, rounds int) string {
	dir := filepath.Join(work, "diag")
	require.NoError(t, os.MkdirAll(dir, 0o700))
	defer os.RemoveAll(dir)
	s, err := Open(Config{Dirs: []string{dir}, CapacityBytes: records * SlotBytes(fioPayload),
		RecordPayloadBytes: fioPayload, Fingerprint: testFP, Direct: DirectRequire})
	require.NoError(t, err)
	defer s.Close()
	src := alignedBuf(fioPayload)
	for i := range src {
		src[i] = byte(i * 131)
	}
	require.NoError(t, forEach(1, records, func(_ int, k [16]byte) error { return s.Put(k, src) }))
	d := s.dirs[0]
	for i := range records {
		require.Equal(t, int32(i), s.index[key(int(i))], "Put filled the file in slot order")
	}
	statPath := devStatPath(t, dir)

	whole := alignedBuf(fioRecord) // one buffer, header and payload: what fio reads into
	hdr := alignedBuf(record.HeaderSize)
	payload := alignedBuf(fioPayload)
	loop := func(read func(i int64) (time.Duration, error)) (total, io []time.Duration, gbs float64) {
		total, io = make([]time.Duration, records), make([]time.Duration, records)
		start := time.Now()
		for i := range records {
			t0 := time.Now()
			d, err := read(i)
			require.NoError(t, err)
			total[i], io[i] = time.Since(t0), d
		}
		return total, io, float64(records*fioRecord) / time.Since(start).Seconds()
	}
	timed := func(f func() error) (time.Duration, error) {
		t0 := time.Now()
		err := f()
		return time.Since(t0), err
	}
	// A huge-page buffer (THP, madvise): the payload one 2 MiB page, the
	// header the last 4 KiB of the page before it, so that a whole record
	// is two physically contiguous pieces.
	huge := hugeBuf(t, 6<<20)
	hugeWhole, hugePayload := huge[2<<20-record.HeaderSize:4<<20], huge[2<<20:4<<20]
	// A ring of huge pages, one record's payload each, taken in turn: as a
	// Load of consecutive disk blocks reads them into distinct pool slots
	// (no read lands in memory the CPU just checksummed).
	const ringSlots = 8
	ring := hugeBuf(t, ringSlots*2<<20)
	slot := func(i int64) []byte { k := int(i%ringSlots) * 2 << 20; return ring[k : k+fioPayload] }
	var getIO time.Duration
	getRing := func() (total, io []time.Duration, gbs float64) {
		readTimer = func(d time.Duration) { getIO += d }
		defer func() { readTimer = nil }()
		return loop(func(i int64) (time.Duration, error) {
			getIO = 0
			ok, err := s.Get(key(int(i)), slot(i))
			if err == nil && !ok {
				err = fmt.Errorf("record %d: miss", i)
			}
			return getIO, err
		})
	}
	getInto := func(dst []byte) (total, io []time.Duration, gbs float64) {
		readTimer = func(d time.Duration) { getIO += d }
		defer func() { readTimer = nil }()
		return loop(func(i int64) (time.Duration, error) {
			getIO = 0
			ok, err := s.Get(key(int(i)), dst)
			if err == nil && !ok {
				err = fmt.Errorf("record %d: miss", i)
			}
			return getIO, err
		})
	}
	get := func() (total, io []time.Duration, gbs float64) {
		readTimer = func(d time.Duration) { getIO += d }
		defer func() { readTimer = nil }()
		return loop(func(i int64) (time.Duration, error) {
			getIO = 0
			ok, err := s.Get(key(int(i)), payload)
			if err == nil && !ok {
				err = fmt.Errorf("record %d: miss", i)
			}
			return getIO, err
		})
	}
	methods := []q1Method{
		{"fio psync --rw=read, the store's file", func() ([]time.Duration, []time.Duration, float64) {
			gbs, lat := fioRead(t, fio, d.path, records)
			return []time.Duration{lat}, []time.Duration{lat}, gbs
		}},
		{"Go pread loop, one buffer (no CRC)", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				return timed(func() error { return preadFull(d.fd, [][]byte{whole}, i*fioRecord) })
			})
		}},
		{"Go preadv header + payload (no CRC)", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				return timed(func() error { return preadFull(d.fd, [][]byte{hdr, payload}, i*fioRecord) })
			})
		}},
		{"Go preadv header + payload, then CRC", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				io, err := timed(func() error { return preadFull(d.fd, [][]byte{hdr, payload}, i*fioRecord) })
				if err == nil && record.Checksum(payload) == 0 {
					err = fmt.Errorf("record %d: zero CRC", i)
				}
				return io, err
			})
		}},
		{"Go preadv header + payload, then CRC on one core", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				io, err := timed(func() error { return preadFull(d.fd, [][]byte{hdr, payload}, i*fioRecord) })
				if err == nil && record.ChecksumUpdate(0, payload) == 0 {
					err = fmt.Errorf("record %d: zero CRC", i)
				}
				return io, err
			})
		}},
		{"Go preadv header + 7/8, then the last 1/8 (no CRC)", func() ([]time.Duration, []time.Duration, float64) {
			cut := fioPayload - fioPayload/8
			return loop(func(i int64) (time.Duration, error) {
				return timed(func() error {
					if err := preadFull(d.fd, [][]byte{hdr, payload[:cut]}, i*fioRecord); err != nil {
						return err
					}
					return preadFull(d.fd, [][]byte{payload[cut:]}, i*fioRecord+record.HeaderSize+int64(cut))
				})
			})
		}},
		{"Get (split read)", get},
		{"Go pread loop, one buffer in two huge pages (no CRC)", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				return timed(func() error { return preadFull(d.fd, [][]byte{hugeWhole}, i*fioRecord) })
			})
		}},
		{"Go pread into two huge pages, then copy + CRC into the payload buffer", func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				io, err := timed(func() error { return preadFull(d.fd, [][]byte{hugeWhole}, i*fioRecord) })
				if err == nil && record.CopyChecksum(payload, hugeWhole[record.HeaderSize:]) == 0 {
					err = fmt.Errorf("record %d: zero CRC", i)
				}
				return io, err
			})
		}},
		{"Get into a huge page (split read)", func() ([]time.Duration, []time.Duration, float64) { return getInto(hugePayload) }},
		{"Get into a huge page, in one read", func() ([]time.Duration, []time.Duration, float64) {
			saved := splitMinBytes
			defer func() { splitMinBytes = saved }()
			splitMinBytes = 0
			return getInto(hugePayload)
		}},
		{"Get in one read", func() ([]time.Duration, []time.Duration, float64) {
			saved := splitMinBytes
			defer func() { splitMinBytes = saved }()
			splitMinBytes = 0
			return get()
		}},
		{fmt.Sprintf("Go preadv header + payload into a ring of %d huge pages (no CRC)", ringSlots), func() ([]time.Duration, []time.Duration, float64) {
			return loop(func(i int64) (time.Duration, error) {
				return timed(func() error { return preadFull(d.fd, [][]byte{hdr, slot(i)}, i*fioRecord) })
			})
		}},
		{fmt.Sprintf("Get into a ring of %d huge pages (split read)", ringSlots), getRing},
		{fmt.Sprintf("Get into a ring of %d huge pages, in one read", ringSlots), func() ([]time.Duration, []time.Duration, float64) {
			saved := splitMinBytes
			defer func() { splitMinBytes = saved }()
			splitMinBytes = 0
			return getRing()
		}},
	}
	if v := os.Getenv("KVO_DISK_BENCH_Q1SPLITS"); v != "" {
		for _, f := range strings.Split(v, ",") {
			div, err := strconv.ParseInt(f, 10, 64)
			require.NoError(t, err, "KVO_DISK_BENCH_Q1SPLITS=%q", v)
			methods = append(methods, q1Method{fmt.Sprintf("Get, split off the last 1/%d", div), func() ([]time.Duration, []time.Duration, float64) {
				saved := splitTailDiv
				defer func() { splitTailDiv = saved }()
				splitTailDiv = div
				return get()
			}})
		}
	}
	type result struct {
		gbs           []float64
		total, io     []time.Duration
		reqs, sectors int64
	}
	res := make([]result, len(methods))
	for round := range rounds {
		for k := range methods {
			m := (round + k) % len(methods)
			before := readDevStat(t, statPath)
			total, io, gbs := methods[m].pass()
			after := readDevStat(t, statPath)
			r := &res[m]
			r.gbs = append(r.gbs, gbs)
			r.total, r.io = append(r.total, total...), append(r.io, io...)
			r.reqs += after[0] - before[0]
			r.sectors += after[2] - before[2]
		}
	}
	require.Zero(t, s.Stats().Corrupt+s.Stats().IOErrors)

	var out strings.Builder
	fmt.Fprintf(&out, "\n### Q=1 diagnosis: the same %d records of the store's file (%d bytes each), read in slot order, one at a time, %d rounds\n\n", records, fioRecord, rounds)
	fmt.Fprintf(&out, "| method | GB/s (median; passes) | of fio | of Go pread | µs a record, mean / p50 | in preads, mean / p50 | rest, mean | device reads a record | KiB a device read |\n")
	fmt.Fprintf(&out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	fioMed, preadMed := median(res[0].gbs), median(res[1].gbs)
	for m, r := range res {
		n := int64(len(r.gbs)) * records
		per, kib := "-", "-"
		if r.reqs > 0 {
			per = fmt.Sprintf("%.2f", float64(r.reqs)/float64(n))
			kib = fmt.Sprintf("%.0f", float64(r.sectors)*512/1024/float64(r.reqs))
		}
		tm, tp, im, ip := durStats(r.total), durP50(r.total), durStats(r.io), durP50(r.io)
		line := fmt.Sprintf("| %s | %.2f; %s | %.0f%% | %.0f%% | %.0f / %.0f | %.0f / %.0f | %.0f | %s | %s |",
			methods[m].name, median(r.gbs)/1e9, gbs(r.gbs), 100*median(r.gbs)/fioMed, 100*median(r.gbs)/preadMed,
			tm, tp, im, ip, tm-im, per, kib)
		if m == 0 {
			line = fmt.Sprintf("| %s | %.2f; %s | 100%% | %.0f%% | %.0f (from GB/s) | %.0f (fio's mean latency) | | %s | %s |",
				methods[m].name, fioMed/1e9, gbs(r.gbs), 100*fioMed/preadMed, 1e6*float64(fioRecord)/fioMed, im, per, kib)
		}
		fmt.Fprintln(&out, line)
	}
	fmt.Fprintf(&out, "\n- physically contiguous runs (of 4 KiB pages) in the buffers: one buffer %d (of %d pages), header %d, payload %d, huge-page record %d, huge-page payload %d\n",
		physRuns(t, whole), len(whole)/align, physRuns(t, hdr), physRuns(t, payload), physRuns(t, hugeWhole), physRuns(t, hugePayload))
	fmt.Fprintf(&out, "- device: %s (reads completed and sectors read over each method's passes; other processes' reads count too)\n", statPath)
	fmt.Fprintf(&out, "- queue: %s\n", queueFacts(statPath))
	return out.String()
}

// fioRead reads path's first records records with fio psync, one job,
// --rw=read, --readonly, and returns bytes per second and the mean latency
// of a read.
func fioRead(t *testing.T, fio, path string, records int64) (float64, time.Duration) {
	cmd := exec.Command(fio, "--name=kvo", "--filename="+path, "--readonly", "--direct=1", "--ioengine=psync",
		"--numjobs=1", "--rw=read", fmt.Sprintf("--bs=%d", fioRecord), fmt.Sprintf("--size=%d", records*fioRecord),
		"--output-format=json")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "fio: %s", stderr.String())
	var res struct {
		Jobs []struct {
			Read struct {
				BWBytes float64 `json:"bw_bytes"`
				Lat     struct {
					Mean float64 `json:"mean"`
				} `json:"lat_ns"`
			} `json:"read"`
		} `json:"jobs"`
	}
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &res), "fio output: %s", stdout.String())
	require.Len(t, res.Jobs, 1)
	return res.Jobs[0].Read.BWBytes, time.Duration(res.Jobs[0].Read.Lat.Mean)
}

// devStatPath is the stat file of the block device holding dir.
func devStatPath(t *testing.T, dir string) string {
	var st unix.Stat_t
	require.NoError(t, unix.Stat(dir, &st))
	return fmt.Sprintf("/sys/dev/block/%d:%d/stat", unix.Major(st.Dev), unix.Minor(st.Dev))
}

// readDevStat returns a block device's stat fields (reads completed, reads
// merged, sectors read, ms reading, ...); zeros if it cannot be read.
func readDevStat(t *testing.T, path string) []int64 {
	v := make([]int64, 11)
	b, err := os.ReadFile(path)
	if err != nil {
		t.Logf("%s: %v", path, err)
		return v
	}
	for i, f := range strings.Fields(string(b)) {
		if i < len(v) {
			v[i], _ = strconv.ParseInt(f, 10, 64)
		}
	}
	return v
}

// queueFacts lists the request queue limits of the device whose stat file
// is statPath (its queue folder, or its parent's for a partition).
func queueFacts(statPath string) string {
	base := filepath.Dir(statPath)
	q := filepath.Join(base, "queue")
	if _, err := os.Stat(q); err != nil {
		q = filepath.Join(base, "..", "queue")
	}
	var parts []string
	for _, f := range []string{"max_segments", "max_segment_size", "max_sectors_kb", "max_hw_sectors_kb", "read_ahead_kb", "scheduler", "nr_requests"} {
		b, err := os.ReadFile(filepath.Join(q, f))
		if err == nil {
			parts = append(parts, f+" "+strings.TrimSpace(string(b)))
		}
	}
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err == nil {
		parts = append(parts, "THP "+strings.TrimSpace(string(b)))
	}
	return strings.Join(parts, ", ")
}

// hugeBuf maps n bytes of anonymous memory, 2 MiB-aligned, asks for
// transparent huge pages and touches them; the mapping is never unmapped
// (a test's).
func hugeBuf(t *testing.T, n int) []byte {
	m, err := unix.Mmap(-1, 0, n+2<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	require.NoError(t, err)
	off := 0
	if r := int(uintptr(unsafe.Pointer(&m[0])) % (2 << 20)); r != 0 {
		off = 2<<20 - r
	}
	b := m[off : off+n : off+n]
	if err := unix.Madvise(b, unix.MADV_HUGEPAGE); err != nil {
		t.Logf("madvise(MADV_HUGEPAGE): %v", err)
	}
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

// physRuns counts the runs of physically consecutive 4 KiB pages under b
// (from /proc/self/pagemap; 0 where the frame numbers cannot be read, as
// without CAP_SYS_ADMIN). b's pages must be resident.
func physRuns(t *testing.T, b []byte) int {
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return 0
	}
	defer f.Close()
	start := uintptr(unsafe.Pointer(&b[0])) / align
	n := (len(b) + align - 1) / align
	ents := make([]byte, 8*n)
	if _, err := f.ReadAt(ents, int64(start)*8); err != nil {
		t.Logf("pagemap: %v", err)
		return 0
	}
	runs, prev := 0, uint64(0)
	for i := range n {
		e := binary.LittleEndian.Uint64(ents[8*i:])
		pfn := e & (1<<55 - 1)
		if e>>63 == 0 || pfn == 0 {
			return 0
		}
		if i == 0 || pfn != prev+1 {
			runs++
		}
		prev = pfn
	}
	return runs
}

func durStats(v []time.Duration) float64 {
	var sum time.Duration
	for _, d := range v {
		sum += d
	}
	return float64(sum.Nanoseconds()) / 1e3 / float64(len(v))
}

func durP50(v []time.Duration) float64 {
	s := append([]time.Duration(nil), v...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return float64(s[len(s)/2].Nanoseconds()) / 1e3
}
