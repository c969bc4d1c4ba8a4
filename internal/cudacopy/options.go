package cudacopy

// Options of a Copier: the defaults of fields left zero, the Options
// struct, withDefaults, validate and MinDeviceBytes. Plain values: no
// locks.

import "fmt"

// Defaults for Options fields left zero. The copy kernel's launch is chosen
// per direction (see DefaultLaunch).
const (
	DefaultChunkBytes   = 64 << 10
	DefaultDescCapacity = 1 << 16
	DefaultDescBuffers  = 2
	DefaultBatchMax     = 4096
	// DefaultMaxDeviceBytes bounds the device memory of a Copier
	// (Options.MaxDeviceBytes): 256 MiB holds, with the other defaults,
	// three staged copies per direction in flight at once, each with its
	// ring of four 8 MiB staging chunks and two 2 MiB descriptor tables
	// (131072 descriptors: a reload of 2048 blocks of 64 segments), that
	// is 216 MiB, plus Calibrate's 32 MiB device buffer beside them. One
	// staged copy per direction keeps the DMA engines busy while the
	// host enqueues the next, so copies run as fast as with unbounded
	// pools; a copy beyond the bound waits for the oldest one to complete
	// instead of allocating.
	DefaultMaxDeviceBytes = 256 << 20
	// MinChunkBytes keeps chunks at least one warp-iteration of 16-byte
	// accesses long.
	MinChunkBytes = 512
	maxThreads    = 1024
	maxPaceGBps   = 10000
)

// Options configures a Copier. The zero value is valid and means the
// defaults above with automatic method choice.
type Options struct {
	// Method forces one method for every batch (benchmarks, fallback
	// tests). MethodAuto, the zero value, lets Choose pick per batch.
	Method Method
	// CTAs, when set, is the copy kernel's grid size in both directions:
	// the number of SMs it can occupy (at most the device's SM count;
	// default per direction, see DefaultLaunch).
	CTAs int
	// Threads, when set, is the threads per CTA in both directions (a
	// multiple of 32, at most 1024; default per direction).
	Threads int
	// StagedCTAs, when set, is the grid of the device-side kernel of staged
	// copies (SubmitGather, SubmitScatter: between the device staging
	// chunks and the KV cache, device memory on both sides), which CTAs
	// does not set. That kernel runs at the device memory's rate as wide
	// as it is, so its SM-time does not grow with the grid while the
	// wait for the last chunk's scatter (a load) or the first chunk's
	// gather (a store) shrinks with it. Default DefaultStagedCTAs (at most
	// the device's SM count).
	StagedCTAs int
	// GreedyD2H takes the unthrottled D2H launch (GreedyD2HLaunch: a few
	// percent more of the link, at the cost of slowing the model's kernels
	// by up to several times while stores run) as the D2H default.
	GreedyD2H bool
	// ChunkBytes bounds the piece of a segment one warp copies, so that
	// warps stay balanced (default 64 KiB; a multiple of 16, at least 512).
	ChunkBytes int
	// DescCapacity is the number of descriptors in one descriptor buffer,
	// i.e. per kernel launch (default 65536, 2 MiB of table); a batch that
	// needs more is split into several launches.
	DescCapacity int
	// DescBuffers is the number of descriptor buffers allocated by New
	// (default 2, at most what MaxDeviceBytes holds). More are allocated,
	// within MaxDeviceBytes, when all are in flight, and are kept for
	// reuse.
	DescBuffers int
	// BatchMax bounds the copies passed to one cuMemcpyBatchAsync call
	// (default 4096).
	BatchMax int
	// GatherChunkBytes is the size of one device staging chunk of
	// SubmitGather (default DefaultGatherChunk; a multiple of 16 of at least
	// 1 MiB). Chunks are allocated as needed, within MaxDeviceBytes, and
	// kept for reuse.
	GatherChunkBytes int
	// GatherMinRun is the mean host-contiguous run (bytes) from which
	// Gatherable says yes (default DefaultGatherMinRun).
	GatherMinRun int
	// GatherMinRow is the shortest row of a pitched staging DMA: host runs
	// of one length, at least this long and shorter than GatherMinRun, at
	// a constant pitch (one layer of
	// each of many consecutive host slots, as a per-layer load copies) move
	// in one cuMemcpy2DAsync per staging chunk instead of one DMA each,
	// and count as one run for GatherMinRun. Default DefaultGatherMinRow;
	// negative: no pitched DMAs.
	GatherMinRow int
	// GatherRing is the number of staging chunks one SubmitGather reuses
	// in turn (default DefaultGatherRing).
	GatherRing int
	// MaxDeviceBytes bounds the device memory the Copier allocates at any
	// time: descriptor tables (DescCapacity × 32 bytes each), the staging
	// chunks of SubmitGather and SubmitScatter (GatherChunkBytes each) and,
	// while Calibrate runs, its device buffer (Calibrate.TotalBytes).
	// Default DefaultMaxDeviceBytes; at least MinDeviceBytes of the
	// options. Tables and chunks are pooled for reuse; a call that needs
	// more than is free frees idle pooled ones it does not need, then
	// waits (on the calling thread) for the oldest outstanding batch's
	// copies to complete and reuses their memory (Retire is then only
	// bookkeeping). A staged copy whose ring of chunks would not fit takes
	// fewer chunks in turn, down to one. A call that could never fit is
	// ErrDeviceBudget, naming the bytes it needs and the bound.
	MaxDeviceBytes int64
	// NoGather turns SubmitGather off (Gatherable always false).
	NoGather bool
	// Calibration is a saved table for Choose. Without one, Choose uses the
	// uncalibrated rule until Calibrate or SetCalibration installs a table.
	Calibration *Calibration
	// Calibrate configures what Calibrate measures.
	Calibrate CalibrationConfig
	// DMAMargin: MethodAuto takes a DMA method (the batch API, else
	// memcpy) over the kernel when its calibrated rate is at least
	// (1 - DMAMargin) of the kernel's, as the DMA engines leave the SMs to
	// the model (see DefaultDMAMargin). Zero takes DefaultDMAMargin, or
	// PreferDMAMargin with PreferDMA; otherwise in (0, 1).
	DMAMargin float64
	// PreferDMA widens the default DMAMargin to PreferDMAMargin, for
	// serving stacks that want the SMs kept for the model whenever the
	// batch API is close.
	PreferDMA bool
	// PTX replaces the embedded kernels.ptx (a PTX built for another target,
	// or a test driver's image).
	PTX []byte
	// CopyKernel, when set, names the copy kernel of the PTX module for
	// both directions: DefaultCopyKernel (kvo_copy, generic loads and
	// stores), StreamingCopyKernel (kvo_copy_cs: global-space, evict-first
	// loads and stores), SysFenceCopyKernel (kvo_copy_sys: kvo_copy
	// throttled on device-to-host copies by a system fence every
	// FenceBytes, and by PaceGBps) or ProbeCopyKernel (kvo_copy_probe: the
	// same with a read-back of a stored word in place of the fence).
	// Default per direction, see DefaultLaunch. Each direction keeps its
	// default grid unless CTAs and Threads are set too (kvo_copy_sys is
	// meant for 4 × 512, not the D2H default 8 × 192).
	CopyKernel string
	// FenceBytes, when set, is how many bytes each warp of a D2H launch of
	// a throttled kernel (SysFenceCopyKernel, ProbeCopyKernel) stores to
	// host memory between fences or read-backs (a multiple of FenceUnit;
	// default DefaultFenceBytes, or the D2H default launch's, and for
	// kvo_copy_probe SmallSegmentFenceBytes in batches of segments
	// averaging under it; setting FenceBytes turns that off).
	FenceBytes int
	// PaceGBps, when set, is the rate in GB/s that each D2H launch of a
	// throttled kernel keeps its warps under together (each warp
	// waits so that it copies at most its share; 0: no pacing).
	PaceGBps float64
	// UploadOnCopyStream uploads each kernel launch's descriptor table on
	// the copy's own stream right before the launch. By default the
	// upload goes on the Copier's upload stream and the launch waits for it
	// through an event (in line all the same on a stream that is capturing
	// a graph), so that a table's upload overlaps the previous
	// launch instead of holding the copy stream between launches (on the
	// H200, launches of 4096 head-sliced 4 KiB descriptors ran at 87% of
	// the link with the upload in line, 90% with it on a second stream:
	// bench/probes/probe_tma.cu).
	UploadOnCopyStream bool
}

func (o *Options) withDefaults() Options {
	r := *o
	if r.ChunkBytes == 0 {
		r.ChunkBytes = DefaultChunkBytes
	}
	if r.DescCapacity == 0 {
		r.DescCapacity = DefaultDescCapacity
	}
	if r.DescBuffers == 0 {
		r.DescBuffers = DefaultDescBuffers
	}
	if r.BatchMax == 0 {
		r.BatchMax = DefaultBatchMax
	}
	if r.GatherChunkBytes == 0 {
		r.GatherChunkBytes = DefaultGatherChunk
	}
	if r.GatherMinRun == 0 {
		r.GatherMinRun = DefaultGatherMinRun
	}
	if r.GatherMinRow == 0 {
		r.GatherMinRow = DefaultGatherMinRow
	}
	if r.GatherRing == 0 {
		r.GatherRing = DefaultGatherRing
	}
	if r.MaxDeviceBytes == 0 {
		r.MaxDeviceBytes = DefaultMaxDeviceBytes
	}
	if r.DMAMargin == 0 {
		r.DMAMargin = DefaultDMAMargin
		if r.PreferDMA {
			r.DMAMargin = PreferDMAMargin
		}
	}
	r.Calibrate = r.Calibrate.withDefaults()
	return r
}

func (o *Options) validate(sms int) error {
	switch {
	case !o.Method.valid():
		return fmt.Errorf("%w: Method %d", ErrInvalidOption, int(o.Method))
	case o.ChunkBytes < MinChunkBytes || o.ChunkBytes%kernelAlign != 0:
		return fmt.Errorf("%w: ChunkBytes %d is not a multiple of %d of at least %d", ErrInvalidOption, o.ChunkBytes, kernelAlign, MinChunkBytes)
	case o.DescCapacity < 1 || o.DescCapacity > 1<<24:
		return fmt.Errorf("%w: DescCapacity %d not in [1, %d]", ErrInvalidOption, o.DescCapacity, 1<<24)
	case o.DescBuffers < 0:
		return fmt.Errorf("%w: DescBuffers %d is negative", ErrInvalidOption, o.DescBuffers)
	case o.BatchMax < 1:
		return fmt.Errorf("%w: BatchMax %d is not positive", ErrInvalidOption, o.BatchMax)
	case o.GatherChunkBytes < minGatherChunk || o.GatherChunkBytes%kernelAlign != 0 || o.GatherChunkBytes > 1<<30:
		return fmt.Errorf("%w: GatherChunkBytes %d is not a multiple of %d in [%d, %d]", ErrInvalidOption, o.GatherChunkBytes, kernelAlign, minGatherChunk, 1<<30)
	case o.GatherMinRun < 1:
		return fmt.Errorf("%w: GatherMinRun %d is not positive", ErrInvalidOption, o.GatherMinRun)
	case o.GatherRing < 1 || o.GatherRing > 64:
		return fmt.Errorf("%w: GatherRing %d not in [1, 64]", ErrInvalidOption, o.GatherRing)
	case !(o.DMAMargin > 0 && o.DMAMargin < 1):
		return fmt.Errorf("%w: DMAMargin %v not in (0, 1)", ErrInvalidOption, o.DMAMargin)
	}
	for _, dir := range []Path{D2H, H2D} {
		if err := o.launch(dir).validate(dir, sms); err != nil {
			return err
		}
	}
	if o.StagedCTAs < 0 || o.StagedCTAs > sms {
		return fmt.Errorf("%w: StagedCTAs %d not in [0, %d] (the device's SM count; 0: the default %d)", ErrInvalidOption, o.StagedCTAs, sms, DefaultStagedCTAs)
	}
	if m := MinDeviceBytes(*o); o.MaxDeviceBytes < m {
		return fmt.Errorf("%w: MaxDeviceBytes %d is below the minimum %d (one descriptor table of %d bytes and one staging chunk of %d bytes)",
			ErrInvalidOption, o.MaxDeviceBytes, m, int64(o.DescCapacity)*descSize, m-int64(o.DescCapacity)*descSize)
	}
	if o.FenceBytes != 0 || o.PaceGBps != 0 {
		if l := o.launch(D2H); !l.Throttled() {
			return fmt.Errorf("%w: FenceBytes %d and PaceGBps %v are only for a throttled CopyKernel such as %q, not %q", ErrInvalidOption, o.FenceBytes, o.PaceGBps, SysFenceCopyKernel, l.Kernel)
		}
	}
	if o.Calibration != nil {
		if err := o.Calibration.Validate(); err != nil {
			return err
		}
	}
	return o.Calibrate.validate()
}

// MinDeviceBytes is the least Options.MaxDeviceBytes that o (defaults
// applied) accepts: one descriptor table (DescCapacity × 32 bytes) and,
// unless NoGather, one staging chunk (GatherChunkBytes).
func MinDeviceBytes(o Options) int64 {
	o = o.withDefaults()
	n := int64(o.DescCapacity) * descSize
	if !o.NoGather {
		n += int64(o.GatherChunkBytes)
	}
	return n
}
