package mmapmem

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Resident reports how many base pages of r's mapping are resident in
// memory (mincore(2)), out of the total number of base pages mapped.
func Resident(r *Region) (pages, total int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, 0, fmt.Errorf("%w: resident pages of %s", ErrClosed, r)
	}
	page := int64(os.Getpagesize())
	total = int((r.mapped + page - 1) / page)
	vec := make([]byte, total)
	_, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(r.ptr), uintptr(r.mapped), uintptr(unsafe.Pointer(&vec[0])))
	if errno != 0 {
		return 0, 0, fmt.Errorf("mmapmem: mincore %s: %w", r, errno)
	}
	for _, v := range vec {
		if v&1 != 0 {
			pages++
		}
	}
	return pages, total, nil
}

// VMAFlags returns the VmFlags of the mapping (VMA) containing addr, read
// from /proc/self/smaps: two-letter codes such as "dc" (MADV_DONTFORK),
// "dd" (MADV_DONTDUMP), "hg" (MADV_HUGEPAGE) and "ht" (hugetlbfs).
func VMAFlags(addr uintptr) ([]string, error) {
	fields, err := smapsEntry(addr)
	if err != nil {
		return nil, err
	}
	return strings.Fields(fields["VmFlags"]), nil
}

// HugeBytes returns how many bytes of r's mapping are backed by
// transparent huge pages (AnonHugePages, or ShmemPmdMapped for a memfd),
// read from /proc/self/smaps. hugetlbfs regions report their whole mapping.
func HugeBytes(r *Region) (int64, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return 0, fmt.Errorf("%w: huge pages of %s", ErrClosed, r)
	}
	if r.hugeTLB {
		return r.mapped, nil
	}
	fields, err := smapsEntry(uintptr(r.ptr))
	if err != nil {
		return 0, err
	}
	key := "AnonHugePages"
	if r.fd >= 0 {
		key = "ShmemPmdMapped"
	}
	kb, _, _ := strings.Cut(strings.TrimSpace(fields[key]), " ")
	v, err := strconv.ParseInt(kb, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("mmapmem: %s of %s in /proc/self/smaps: %q: %w", key, r, fields[key], err)
	}
	return v << 10, nil
}

// smapsEntry returns the "Key: value" lines of the /proc/self/smaps entry
// of the mapping (VMA) containing addr.
func smapsEntry(addr uintptr) (map[string]string, error) {
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return nil, fmt.Errorf("mmapmem: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	var fields map[string]string
	for sc.Scan() {
		line := sc.Text()
		if lo, hi, ok := vmaRange(line); ok {
			if fields != nil {
				return fields, nil
			}
			if lo <= addr && addr < hi {
				fields = map[string]string{}
			}
			continue
		}
		if k, v, ok := strings.Cut(line, ":"); ok && fields != nil {
			fields[k] = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("mmapmem: read /proc/self/smaps: %w", err)
	}
	if fields == nil {
		return nil, fmt.Errorf("mmapmem: no mapping contains address %#x", addr)
	}
	return fields, nil
}

// vmaRange parses an smaps header line "start-end perms offset dev inode [path]".
func vmaRange(line string) (lo, hi uintptr, ok bool) {
	field, _, _ := strings.Cut(line, " ")
	a, b, found := strings.Cut(field, "-")
	if !found {
		return 0, 0, false
	}
	l, err1 := strconv.ParseUint(a, 16, 64)
	h, err2 := strconv.ParseUint(b, 16, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return uintptr(l), uintptr(h), true
}
