package cuda

import "strings"

// SysfsBusID turns a CUDA or nvidia-smi PCI bus id ("00000000:19:00.0",
// "0000:19:00.0") into the name sysfs gives the device under
// /sys/bus/pci/devices: lower case, a 4-digit domain.
func SysfsBusID(id string) string {
	id = strings.ToLower(strings.TrimSpace(id))
	dom, rest, ok := strings.Cut(id, ":")
	if !ok {
		return id
	}
	if len(dom) > 4 {
		dom = dom[len(dom)-4:]
	}
	return strings.Repeat("0", 4-len(dom)) + dom + ":" + rest
}
