// Package benchgpu measures kvoffload against the references it must beat,
// in the same run on the same machine (absolute figures drift between
// machines; doc/ANCHORS.md has the reference figures): the throughput of
// the copy methods against the link (MeasureThroughput), block stores and
// reloads (MeasureBlocks), pinning (MeasurePinning,
// MeasurePinningVariants) and the copy kernel's variants
// (MeasureKernelVariants). It drives the driver itself (internal/cuda,
// internal/cudacopy), so it is internal: the command-line tool
// (kvoffload bench) and its own tests are its callers; package bench keeps
// the public, GPU-free part (the SVG charts its results are drawn with).
//
// Each measurement is a plain function returning typed results plus a
// Format function that renders them as a markdown table, so that tests,
// benchmarks and the command-line tool print the same thing. Measurements
// that need a GPU take a cuda.Driver; their tests skip without one
// (internal/cuda/cudatest) and run on the GPU machine from binaries built
// here (make gpu-bins), by scripts/gpu/run.sh's suites bench, blocks and
// sweep:NAME; their results are in bench/results/<machine>/, listed in
// bench/results/README.md. Nothing here asserts a speed: targets are printed
// next to results.
package benchgpu
