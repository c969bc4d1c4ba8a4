// Package cudacopy moves batches of scattered segments between device memory
// and registered host memory on a CUDA stream, at link speed from 4 KiB
// segments up, with one of three methods:
//
//   - memcpy: one cuMemcpyAsync per segment (always available; the fallback);
//   - batch: cuMemcpyBatchAsync (drivers ≥ 12.8), up to Options.BatchMax
//     copies per call;
//   - kernel: kvo_copy (H2D) and kvo_copy_probe (D2H) from kernels.cu,
//     compiled to PTX for compute_80 and embedded (see PTX), on a bounded
//     grid (4 CTAs × 512 threads H2D, 8 × 192 D2H, see DefaultLaunch) so
//     the model's kernels keep the rest of the GPU. D2H warps read back a
//     word they stored after every 4 KiB (8 KiB in batches of smaller
//     segments), and wait for each read-back before issuing the next:
//     posted stores to host memory, unbounded, back up behind the link
//     and hold up every other SM's memory traffic (a matrix product beside
//     them runs several times slower), and the read's round trip grows
//     with that backlog. Each segment is split into
//     chunks of at most Options.ChunkBytes; one warp copies one chunk with
//     16-byte accesses, several loads in flight per lane. Host memory is
//     addressed through its registered pointer where the device allows it
//     (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM), else through the device
//     pointer of a range given to AddHostRange.
//
// Strided copies (Submit2D, strided.go) move Segment2D: rows at a pitch
// on either side, such as one KV head of a token-major block (its tokens at
// the stride of the rank's heads) to or from its contiguous run in a
// head-major host slot. The copy kernels take them as 2-D descriptors
// (Desc with aux != 0) when the PTX image has the marker kernel
// kvo_desc2d (Capabilities.Kernel2D), one descriptor per chunk of rows;
// otherwise, and for the memcpy and batch methods, each row is a copy of
// its own (the driver binding has no cuMemcpy2DAsync).
//
// Template copies (NewTemplate, SubmitTemplate; template.go) move many
// blocks of one shape: the template's pieces (one block's segments, each
// with its device stride per block id) are encoded once into the table,
// then 16 bytes a block (its host slot and id), and kvo_copy_tmpl
// (kvo_copy_tmpl_probe for D2H) computes work item w's descriptor as piece
// w%pieces of block w/pieces. A template needs the kernel method and the
// template kernels in the PTX image (TemplateAvailable); blocks that do not
// fit one table are split over several launches.
//
// Staged copies (SubmitGather, SubmitScatter; gather.go) move whole blocks —
// segments from many device tensors, back to back in a host slot — with one
// DMA per block between the host and device staging and the kernel on the
// device side only; Gatherable and Scatterable say when a store or a load
// should go that way. A staged batch writes and uploads all its descriptors
// before its first DMA, so that no descriptor upload waits behind a chunk's
// DMA on a copy engine; a scatter, where registered host pointers are
// device pointers, uploads nothing: its kernels read the pinned tables,
// and each chunk's descriptors are written once its DMA is enqueued, so
// the first DMA starts before the batch's descriptors are written.
// SubmitScatterOpen leaves the final join of the load stream to the last
// scatter to its caller, so that the next batch's DMAs start at once.
//
// MethodAuto picks per batch from a calibration table measured on the device
// (Calibrate: each method's pipelined rate, several back-to-back Submits, as
// the engine runs them) or loaded (Options.Calibration); Options.Method
// forces one. A DMA method within Options.DMAMargin of the kernel's rate
// (default 3%; 15% with Options.PreferDMA) is taken over the kernel, which
// takes SMs from the model's kernels where the DMA engines do not.
//
// Ownership and invariants:
//
//   - Submit validates the whole batch before it enqueues anything.
//   - The kernel method builds its descriptor table in a pinned staging
//     buffer, uploads it to a device table on the same stream and launches;
//     the pair of buffers belongs to the returned Ticket until Retire, which
//     the caller calls only after an event recorded after the Submit has
//     completed. Buffers are pooled, so steady-state Submit does not
//     allocate; a batch larger than one buffer uses several launches.
//   - A driver failure part-way through a Submit withdraws the buffers that
//     enqueued work may still read; they are freed only by Close.
//   - Fill and Checksum (kvo_fill, kvo_checksum) are test and demo helpers
//     whose results FillPattern and HostChecksum compute on the host.
//
// Calls that reach the driver need the device's context current on the
// calling OS thread.
package cudacopy
