//go:build cgo

package cuda

// LoadFrom exposes loadFrom to the external tests.
var LoadFrom = loadFrom
