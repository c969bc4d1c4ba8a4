package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// backendChoice is the outcome of selectBackend.
type backendChoice struct {
	name   Backend
	reason string
	drv    cuda.Driver // nil on the host backend
	busID  string      // the device's PCI bus id (CUDA only)
}

// selectBackend resolves Config.Backend: "auto" picks CUDA when the driver
// loads and device exists, else the host backend, and says why; "cuda"
// fails with ErrNoDriver when it cannot; "host" never touches the driver.
func selectBackend(want Backend, device int, load func() (cuda.Driver, error)) (backendChoice, error) {
	if want == BackendHost {
		return backendChoice{name: BackendHost, reason: "asked for (Backend \"host\")"}, nil
	}
	drv, err := load()
	if err == nil {
		var n int
		n, err = drv.DeviceCount()
		switch {
		case err != nil:
			err = fmt.Errorf("%w: counting devices: %w", ErrNoDriver, err)
		case device >= n:
			err = fmt.Errorf("%w: device %d asked for, the driver sees %d device(s)", ErrNoDriver, device, n)
		}
	}
	var bus string
	if err == nil {
		var dev cuda.Device
		if dev, err = drv.DeviceGet(device); err == nil {
			bus, err = drv.DevicePCIBusID(dev)
		}
		if err != nil {
			err = fmt.Errorf("%w: device %d: %w", ErrNoDriver, device, err)
		}
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
