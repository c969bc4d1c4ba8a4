package register_test

import (
	"testing"

	"github.com/stretchr/testify/require"
	"pgregory.net/rapid"

	"github.com/kvoffload/kvoffload/internal/cuda"
	"github.com/kvoffload/kvoffload/internal/cuda/cudafake"
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/mmapmem"
	"github.com/kvoffload/kvoffload/register"
)

type regionState int

const (
	open regionState = iota
	registered
	closed
)

// TestPinnerStateMachine runs random sequences of Register (some with a
// driver fault injected at a random range), Unregister, Close and Release
// over a few regions and checks every result and the stats against a model.
func TestPinnerStateMachine(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		fd := cudafake.New(cudafake.Options{CheckContext: true})
		defer func() { require.NoError(rt, fd.Close()) }()
		ctx, err := fd.PrimaryCtxRetain(0)
		require.NoError(rt, err)
		p, err := register.NewCUDA(cudadev.Bind(fd, ctx), register.CUDAOptions{RangeLimit: 16 * kib})
		require.NoError(rt, err)

		const n = 3
		regions := make([]*mmapmem.Region, n)
		state := make([]regionState, n)
		for i := range regions {
			regions[i], err = mmapmem.New(int64(i+1)*20*kib+int64(i), mmapmem.Options{NoTHP: true, PrefaultThreads: 1})
			require.NoError(rt, err)
		}
		defer func() {
			for i, r := range regions {
				if state[i] != closed {
					require.NoError(rt, register.Release(p, r))
				}
			}
			require.Zero(rt, fd.Live().Registrations)
			require.NoError(rt, fd.PrimaryCtxRelease(0))
		}()

		rt.Repeat(map[string]func(*rapid.T){
			"register": func(rt *rapid.T) {
				i := rapid.IntRange(0, n-1).Draw(rt, "region")
				err := p.Register(regions[i])
				switch state[i] {
				case closed:
					require.ErrorIs(rt, err, mmapmem.ErrClosed)
				case registered:
					require.ErrorIs(rt, err, register.ErrAlreadyRegistered)
				default:
					require.NoError(rt, err)
					state[i] = registered
				}
			},
			"register failing": func(rt *rapid.T) {
				i := rapid.IntRange(0, n-1).Draw(rt, "region")
				if state[i] != open {
					rt.Skip("only an open, unregistered region reaches the driver")
				}
				ranges := int((regions[i].Mapped() + 16*kib - 1) / (16 * kib))
				k := rapid.IntRange(0, ranges-1).Draw(rt, "failing range")
				fd.FailAt(cuda.OpMemHostRegister, fd.Calls(cuda.OpMemHostRegister)+k+1, cuda.ErrorOutOfMemory)
				var re *register.RangeError
				require.ErrorAs(rt, p.Register(regions[i]), &re)
				require.Equal(rt, k, re.Index)
			},
			"unregister": func(rt *rapid.T) {
				i := rapid.IntRange(0, n-1).Draw(rt, "region")
				err := p.Unregister(regions[i])
				if state[i] == registered {
					require.NoError(rt, err)
					state[i] = open
				} else {
					require.ErrorIs(rt, err, register.ErrNotRegistered)
				}
			},
			"close": func(rt *rapid.T) {
				i := rapid.IntRange(0, n-1).Draw(rt, "region")
				err := regions[i].Close()
				switch state[i] {
				case closed:
					require.ErrorIs(rt, err, mmapmem.ErrClosed)
				case registered:
					require.ErrorIs(rt, err, mmapmem.ErrHeld)
				default:
					require.NoError(rt, err)
					state[i] = closed
				}
			},
			"release": func(rt *rapid.T) {
				i := rapid.IntRange(0, n-1).Draw(rt, "region")
				err := register.Release(p, regions[i])
				if state[i] == closed {
					require.ErrorIs(rt, err, mmapmem.ErrClosed)
				} else {
					require.NoError(rt, err)
					state[i] = closed
				}
			},
			"": func(rt *rapid.T) {
				var bytes int64
				count := 0
				for i, r := range regions {
					require.Equal(rt, state[i] == registered, p.Registered(r))
					if state[i] == registered {
						count++
						bytes += r.Mapped()
					}
				}
				st := p.Stats()
				require.Equal(rt, count, st.Regions)
				require.Equal(rt, bytes, st.RegisteredBytes)
				require.GreaterOrEqual(rt, st.PeakRegisteredBytes, bytes)
				live := fd.Live()
				require.Equal(rt, uint64(bytes), live.RegisteredBytes, "the driver holds exactly what the pinner reports")
			},
		})
	})
}
