package offload

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestHistogram(t *testing.T) {
	var h histogram
	require.Equal(t, time.Duration(0), h.snapshot().quantile(0.5))
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 250; i++ {
				h.observe(time.Duration(i%10+1) * 100 * time.Microsecond)
			}
		}()
	}
	wg.Wait()
	s := h.snapshot()
	require.Equal(t, int64(1000), s.Count)
	var sum int64
	for _, c := range s.Counts {
		sum += c
	}
	require.Equal(t, s.Count, sum)
	require.Equal(t, 550*time.Microsecond, s.mean())
	require.Equal(t, 1024*time.Microsecond, s.quantile(0.99), "1 ms falls in [512 µs, 1024 µs)")
	require.Equal(t, 0, bucketOf(500*time.Nanosecond))
	require.Equal(t, 1, bucketOf(time.Microsecond))
	require.Equal(t, histogramBuckets-1, bucketOf(time.Hour))
}

func TestOutcomeString(t *testing.T) {
	require.Equal(t, "refused-full", OutcomeRefusedFull.String())
	require.Equal(t, "missing", OutcomeMissing.String())
	require.Equal(t, "outcome(200)", Outcome(200).String())
	var s Stats
	s.Outcomes[OutcomeLoaded] = 3
	require.Equal(t, int64(3), s.Outcome(OutcomeLoaded))
	require.Zero(t, s.Outcome(Outcome(99)))
}
