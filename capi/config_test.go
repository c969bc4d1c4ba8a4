package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvoffload/kvoffload/offload"
)

func TestParseConfig(t *testing.T) {
	cfg, sim, err := parseConfig(`{"pool_bytes": 4096, "backend": "host", "sim": {"seed": 3, "max_delay_ns": 10},
		"layout": {"kind": "cross-layer", "layers": 2, "num_blocks": 4}}`)
	require.NoError(t, err)
	require.Equal(t, int64(4096), cfg.PoolBytes)
	require.Equal(t, offload.LayoutCrossLayer, cfg.Layout.Kind)
	require.Equal(t, int64(3), sim.Seed)
	for _, bad := range []string{``, `{`, `[]`, `{"pool_bytes": "x"}`, `{"nope": 1}`, `{"layout": {"nope": 1}}`,
		`{} {}`, `{"sim": {"min_delay_ns": 5, "max_delay_ns": 1}}`, `{"sim": {"min_delay_ns": -1}}`,
		`{"namespace": "ns\u0000garbage"}`} {
		_, _, err := parseConfig(bad)
		require.ErrorIs(t, err, offload.ErrInvalidConfig, "%q", bad)
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add(`{"pool_bytes": 4096, "layout": {"kind": "layer-separate", "layers": 1}}`)
	f.Add(`{"sim": {"seed": 1}}`)
	f.Add(`{"pool_bytes": 1} trailing`)
	f.Fuzz(func(t *testing.T, text string) {
		cfg, sim, err := parseConfig(text)
		if err != nil {
			require.ErrorIs(t, err, offload.ErrInvalidConfig)
			require.Zero(t, cfg.PoolBytes)
			return
		}
		require.GreaterOrEqual(t, sim.MaxDelay, sim.MinDelay)
		require.GreaterOrEqual(t, int64(sim.MinDelay), int64(0))
	})
}

// TestParseConfigHeads: the C ABI's JSON carries the model's KV heads, the
// rank's head range and the device order, and an unknown order is refused.
func TestParseConfigHeads(t *testing.T) {
	cfg, _, err := parseConfig(`{"pool_bytes": 1048576, "backend": "host", "partial_timeout": 5000000000,
		"layout": {"kind": "layer-separate", "layers": 2, "kv_heads": 2, "model_kv_heads": 8, "head_first": 4,
		"order": "token-major", "head_dim": 64, "dtype_bytes": 2, "tokens_per_block": 16, "num_blocks": 4}}`)
	require.NoError(t, err)
	require.Equal(t, 8, cfg.Layout.ModelKVHeads)
	require.Equal(t, 4, cfg.Layout.HeadFirst)
	require.Equal(t, offload.OrderTokenMajor, cfg.Layout.Order)
	require.Equal(t, int64(5e9), int64(cfg.PartialTimeout))
	_, _, err = parseConfig(`{"pool_bytes": 1, "layout": {"kind": "mla", "order": "sideways"}}`)
	require.ErrorIs(t, err, offload.ErrInvalidConfig)
	require.ErrorContains(t, err, "sideways")
}
