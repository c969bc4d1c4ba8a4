package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cudadev"
)

// backendChoice is the outcome of selectBackend.
type backendChoice struct {
	name   Backend
	reason string
	drv    *cudadev.Driver // nil on the host backend
	busID  string          // the device's PCI bus id (CUDA only)
}

// selectBackend resolves Config.Backend: "auto" picks CUDA when the driver
// loads and device exists, else the host backend, and says why; "cuda"
// fails with ErrNoDriver when it cannot; "host" never touches the driver.
func selectBackend(want Backend, device int, load func() (*cudadev.Driver, error)) (backendChoice, error) {
	if want == BackendHost {
		return backendChoice{name: BackendHost, reason: "asked for (Backend \"host\")"}, nil
	}
	drv, err := load()
	var bus string
	if err == nil {
		bus, err = drv.Probe(device)
	}
	if err != nil {
		if want == BackendCUDA {
			return backendChoice{}, fmt.Errorf("offload: Backend \"cuda\": %w", err)
		}
		return backendChoice{name: BackendHost, reason: "auto: CUDA unavailable (" + err.Error() + ")"}, nil
	}
	reason := "asked for (Backend \"cuda\")"
	if want == BackendAuto {
		reason = fmt.Sprintf("auto: libcuda loaded, device %d at PCI %s", device, bus)
	}
	return backendChoice{name: BackendCUDA, reason: reason, drv: drv, busID: bus}, nil
}
