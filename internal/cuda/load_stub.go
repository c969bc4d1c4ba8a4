package cuda

// Load binds libcuda.so.1 and calls cuInit(0). It returns an error wrapping
// ErrNoDriver when the library or a required symbol is missing.
//
// Placeholder until the dlopen binding lands (it replaces this file).
func Load() (Driver, error) { return nil, ErrNoDriver }
