package cudacopy

// Registered host ranges, which the kernel's descriptors translate host
// addresses through: AddHostRange, RemoveHostRange and the table a launch
// reads. Writers take Copier.mu and replace the copy-on-write table
// (Copier.hosts); hostTableForKernel loads it without a lock.

import (
	"fmt"
	"unsafe"
)

// AddHostRange tells the Copier about a registered host range. Where the
// device cannot use registered host pointers directly it looks up the
// range's device pointer (cuMemHostGetDevicePointer, which needs the range
// registered with CU_MEMHOSTREGISTER_DEVICEMAP) and the kernel then
// translates every host address through this table; otherwise the table
// only records the range.
func (c *Copier) AddHostRange(base uintptr, size uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return ErrClosed
	}
	r := hostRange{base: uint64(base), size: size, dev: uint64(base)}
	if !c.identity && base != 0 {
		d, err := c.drv.MemHostGetDevicePointer(*(*unsafe.Pointer)(unsafe.Pointer(&base)))
		if err != nil {
			return fmt.Errorf("cudacopy: device pointer of host range %#x+%d: %w", base, size, err)
		}
		r.dev = uint64(d)
	}
	t := &hostTable{ranges: append([]hostRange(nil), c.hosts.Load().ranges...)}
	if err := t.add(r); err != nil {
		return err
	}
	c.hosts.Store(t)
	return nil
}

// RemoveHostRange forgets the range starting at base. The caller must have
// retired every batch that used it.
func (c *Copier) RemoveHostRange(base uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &hostTable{ranges: append([]hostRange(nil), c.hosts.Load().ranges...)}
	if err := t.remove(uint64(base)); err != nil {
		return err
	}
	c.hosts.Store(t)
	return nil
}

// hostTableForKernel returns the translation table, or nil for identity.
func (c *Copier) hostTableForKernel() *hostTable {
	if c.identity {
		return nil
	}
	return c.hosts.Load()
}
