//go:build race

package offload

// raceEnabled: the test binary is built with -race (FuzzNewConfig then runs
// its child without the address-space limit).
const raceEnabled = true
