//go:build cgo

package main

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
)

// kvo_wait_grown tells a growth error from a timeout and from Close, even
// when the growth error wraps something that maps to another code.
func TestGrowthCode(t *testing.T) {
	growth := fmt.Errorf("offload: background growth stopped: %w", fmt.Errorf("%w: mlock refused", offload.ErrInsufficientMemory))
	for _, c := range []struct {
		err    error
		failed bool
		want   int
	}{
		{nil, false, codeOK},
		{growth, true, codeGrowth},
		{fmt.Errorf("%w: growth stopped by Close", offload.ErrClosed), false, codeClosed},
		{context.DeadlineExceeded, false, codeTimeout},
		{context.DeadlineExceeded, true, codeGrowth}, // failed meanwhile: the failure wins
		{errors.New("something else"), false, codeFail},
	} {
		require.Equal(t, c.want, int(growthCode(c.err, c.failed)), "%v (growth failed: %v)", c.err, c.failed)
	}
}

func TestCappedMaxProcs(t *testing.T) {
	for _, c := range []struct {
		env           string
		current, want int
	}{
		{"", 2, 0},   // at most maxProcs CPUs: the runtime's default stays
		{"", 8, 0},   //
		{"", 64, 8},  // more: capped
		{"3", 64, 0}, // set by the user: kept
		{"32", 32, 0},
	} {
		require.Equal(t, c.want, cappedMaxProcs(c.env, c.current), "GOMAXPROCS=%q, current %d", c.env, c.current)
	}
}

// Bad configuration and arguments are KVO_EINVAL, whatever wraps them: a
// NUMA node the machine lacks is offload.ErrInvalidConfig (issue 19).
func TestCodeInvalid(t *testing.T) {
	for _, err := range []error{
		fmt.Errorf("%w: NUMANode \"99\": no such node", offload.ErrInvalidConfig),
		fmt.Errorf("kvoffload: create: %w", fmt.Errorf("%w: layer 99", offload.ErrInvalidArgument)),
		fmt.Errorf("%w: PoolBytes too small", offload.ErrPoolTooSmall),
	} {
		require.Equal(t, codeInval, int(code(err)), "%v", err)
	}
}
