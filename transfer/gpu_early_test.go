package transfer

import (
	"bytes"
	"math/rand"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// TestGPUEarlyEvents: on the real driver, early events are on (stream
// memory operations), Submit of a load returns while its third part is not
// built, a caller stream waiting on the op's event and on layer 0's passes
// only after the bytes they cover have arrived, and a layered op's layer 0
// event completes while layer 2 is not built.
func TestGPUEarlyEvents(t *testing.T) {
	const seg, n = 8 << 20, 4 * (8 << 20)
	e := newGPUEnv(t, 2*n, Config{})
	require.True(t, e.cu.EarlyEvents(), "early events off: %s", e.cu.EarlyEventsOff())
	drv := e.g.Drv
	src := randBytes(rand.New(rand.NewSource(21)), n)
	copy(e.hostBuf, src)
	back := func(m uint64) []byte {
		require.NoError(t, drv.Memcpy(cuda.DevicePtr(e.host+n), cuda.DevicePtr(e.dev), m))
		return append([]byte(nil), e.hostBuf[n:n+m]...)
	}
	build := func(gated int, gate <-chan struct{}) func(int, []Segment) ([]Segment, error) {
		return func(p int, dst []Segment) ([]Segment, error) {
			if p == gated {
				<-gate
			}
			off := uint64(p) * seg
			return append(dst, Segment{Dev: e.dev + off, Host: e.host + off, Len: seg}), nil
		}
	}
	for _, layered := range []bool{false, true} {
		require.NoError(t, drv.MemsetD8(cuda.DevicePtr(e.dev), 0, n))
		gate := make(chan struct{})
		req := Request{Dir: Load, Events: true, Parts: 4, Layered: layered, Bytes: n, Build: build(2, gate)}
		op, err := submitWithin(t, e.s, req, 5*time.Second)
		require.NoError(t, err)
		ev, err := op.Event()
		require.NoError(t, err)
		s := e.stream(t)
		mine := e.event(t)
		require.NoError(t, drv.StreamWaitEvent(s, cuda.Event(ev), cuda.EventWaitDefault))
		require.NoError(t, drv.EventRecord(mine, s))
		if layered {
			l0, err := op.LayerEvent(0)
			require.NoError(t, err)
			require.NoError(t, drv.EventSynchronize(cuda.Event(l0)))
			require.True(t, bytes.Equal(src[:seg], back(seg)), "layer 0's event completed before its bytes arrived")
			l2, err := op.LayerEvent(2)
			require.NoError(t, err)
			ok, err := drv.EventQuery(cuda.Event(l2))
			require.NoError(t, err)
			require.False(t, ok, "layer 2's event completed before layer 2 was built")
		}
		time.Sleep(50 * time.Millisecond)
		ok, err := drv.EventQuery(mine)
		require.NoError(t, err)
		require.False(t, ok, "the caller passed the op's event before its last parts were built (layered %v)", layered)
		close(gate)
		require.NoError(t, drv.EventSynchronize(mine))
		require.True(t, bytes.Equal(src, back(n)), "the caller passed the op's event before the bytes arrived (layered %v)", layered)
		require.NoError(t, op.Wait())
		require.NoError(t, op.Release())
	}
}
