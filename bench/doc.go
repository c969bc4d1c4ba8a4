// Package bench is the public, GPU-free part of the module's benchmarks:
// line charts written as SVG without a plotting dependency (Chart, Series,
// RefLine, WriteSVG), in which the throughput results are drawn. The
// measurements themselves, which drive the CUDA driver, are internal
// (internal/benchgpu: kvoffload bench and the GPU suites of
// scripts/gpu/run.sh run them); this folder also holds the Python
// benchmarks (realmodel.py, transformers_cb.py, ...) and their results
// (bench/results/<machine>/, listed in bench/results/README.md).
//
// Invariants: WriteSVG validates the whole chart before it writes: an
// invalid one (ErrChart: no points, mismatched lengths, a value that is
// not finite, a non-positive x on a log axis) writes nothing. The package
// has no state and imports nothing beyond the standard library.
package bench
