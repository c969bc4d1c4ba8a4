//go:build !race

package cudacopy

const raceEnabled = false
