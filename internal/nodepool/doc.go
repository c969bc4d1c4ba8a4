// Package nodepool is the node pool: one pinned-pool owner and one block
// index per machine, shared by every process of a serving stack (one
// process per GPU, a scheduler or router without a GPU). The node
// (Server, `kvoffload serve`) needs no GPU; clients (Client, Dial) copy
// with their own GPUs straight between their device memory and the
// node's regions, which they map: bytes never pass through the node.
//
// # What the node owns
//
//   - The pool: memfd-backed regions (mmapmem, Options.Memfd), allocated
//     (fallocate) and populated at start. Each client receives their file
//     descriptors over the socket (SCM_RIGHTS, message RegionAdded), maps
//     them (mmapmem.OpenMemfd, page tables populated in parallel) and pins
//     them in its own CUDA context (Hooks.RegionAdded). Pages are hugetlbfs
//     pages with ServerConfig.HugeTLB when reserved, transparent huge pages
//     where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them
//     on shared memory (always, within_size, or advise with MADV_HUGEPAGE,
//     which the regions get), base pages where it says never; Server.PageMode
//     and every client's Info say which applies.
//   - The index: one kvcache.Cache over the regions, the same code as the
//     embedded engine's. Its layout comes from the first client; the node
//     keeps one layout per namespace and carves one slot size: a client whose
//     layout differs is refused (ErrLayout).
//   - Every client's reservations (slots reserved for its stores), leases
//     (Lookup) and loads (BeginLoad), per slot handle; and the regions each
//     client has mapped.
//
// # Invariants
//
//   - A slot reserved for a store belongs to the client that reserved it
//     until that client commits it (CommitStore: the block becomes ready,
//     which the client does only once its copy events retired) or aborts
//     it. No other client can commit, abort, unlease or end a load of
//     another's handle: every handle given back is checked against the
//     giver's own holdings, and a handle it does not hold is an error that
//     changes nothing.
//   - The node never hands a slot to a writer while any lease, load or
//     reservation on it is live: kvcache reuses a slot only once its
//     readers and transfers are reported done, and a client's are reported
//     done only by that client, or after that client's process exited.
//   - A client that goes away without saying goodbye (crash, SIGKILL, a
//     closed socket) keeps everything it held until its process has fully
//     exited: the node opens a pidfd for each peer when it connects
//     (SO_PEERPIDFD, or pidfd_open of the SO_PEERCRED pid), so a reused
//     pid is never mistaken for the client, and waits for it to turn
//     readable. Only then are its reservations failed (those blocks never
//     become ready) and its leases and loads ended. A client that says
//     goodbye (Close) vouches that none of its copies is in flight, and is
//     released at once.
//   - A region leaves (Trim) in two steps: it leaves the index at once (no
//     new slot in it, its ready blocks evicted), and once its last
//     reservation, lease and load end, every client that mapped it is told
//     to unmap it (RegionRetire); the node frees it once each has
//     acknowledged or exited.
//   - A node that goes away takes its index with it. Its clients get
//     ErrUnavailable (or misses), retire its regions locally once their
//     own copies on them are done (Hooks.RegionRetiring), keep their GPU
//     state, and reconnect when a node is back; the new node's pool is
//     empty, so nothing they load is ever wrong. Handles of the old node
//     are no-ops to give back, and a commit of one fails.
//   - A message that does not decode, or a request that is not allowed,
//     gets an error reply; the node keeps serving that client and the
//     others. Decoding allocates at most in proportion to the message,
//     itself bounded (package wire).
//
// # One client cannot take the node down
//
// The node is shared by every serving process of the machine, so what one
// client can cost it is bounded, and nothing a client does makes it exit:
//
//   - Connections are capped in total (ServerConfig.MaxConns, by default
//     also kept within what RLIMIT_NOFILE leaves, a connection costing the
//     node its socket and the client's pidfd), per client process
//     (MaxConnsPerClient, the SO_PEERCRED pid) and per user
//     (MaxConnsPerUser, the uid: for a node that admits a group), checked
//     before the pidfd is opened; a connection past a cap is told which,
//     with the count and the limit, and closed at once. A connection has
//     HelloTimeout to say Hello, and until then costs a small receive
//     buffer and one goroutine: the full-size buffers, the push queue and
//     its writer come with the Hello (and Close does not wait for it).
//   - A failed accept (out of descriptors or memory, a connection aborted
//     by its client) never ends Serve: it is counted (Stats.AcceptErrors)
//     and retried after a pause that grows while accepts keep failing.
//     Connected clients are served meanwhile.
//   - Each client process holds at most its share of the pool's slots
//     (ClientShare, counted across its connections): slots reserved for its
//     stores, leased, or loading, a slot once per connection however many
//     leases it has on it. Past its share its stores are refused full, its
//     leasing lookups lease a shorter prefix and its loads find fewer
//     blocks (Stats.OverShare). The others hold at most their shares, so a
//     client within its share is never refused full because of another
//     client, as long as the shares of the clients holding slots at once
//     fit the pool (their number times ClientShare at most one).
//   - A reservation neither committed nor aborted within ReserveTimeout
//     expires, also one of a client that left without goodbye: the block
//     never becomes ready, the slot goes back to the pool, and a later
//     commit of it is refused as not the client's. A client must not write
//     into a reservation after its deadline.
//   - A client's leases and loads are counts per slot, each bounded (a
//     request past the bound is cut short, as past the share), and the
//     index bounds a slot's readers likewise (kvcache's maxReaders): no
//     count can overflow. Releasing a client costs in proportion to the
//     slots it held, not the leases it took (kvcache.EndReads).
//
// Starting a node: the whole pool is checked against what the machine
// allows (MemAvailable, the memory cgroup's limit at every level,
// RLIMIT_AS, and with BindNUMA the NUMA node's free memory; the check the
// embedded engine runs, internal/memfit; with HugeTLB only for the part
// the free huge pages do not hold) before anything is mapped, and refused
// with ErrInsufficientMemory naming the limit; the pool is then mapped
// region by region, NewServerContext's context checked between two. The
// node takes an exclusive lock on a file beside its socket before
// it looks at the socket's path and holds it until Close, so that of nodes
// started at once on one path exactly one serves; Close removes the socket
// only if the path is still the socket this node bound. A socket path
// longer than a unix socket address holds (MaxSocketPath) is refused.
//
// # Trust
//
// One node pool is one trust domain: every client maps the whole pool and
// can read and write any slot of it. The socket is created 0600 (0660 and
// owned by ServerConfig.Group when given), and the node admits only peers
// of its own uid, root, or members of that group (SO_PEERCRED). The checks
// above stop a client from releasing another's holdings, not from reading
// or overwriting another's blocks through its mapping: run one node per
// tenant.
//
// What the pidfd does not cover: copies that another process makes on
// the client's behalf and that outlive it. The CUDA MPS server runs the
// clients' work in its own process: a client killed mid-copy may leave a
// DMA that the MPS server still executes into a slot the node has freed.
// The same holds for any helper process a client shares its GPU context
// or its mapping with (a forked child inherits no mapping: regions are
// MADV_DONTFORK). Where MPS is used, a crashed client's slots are only
// safe to reuse once the MPS server has torn down that client's context.
//
// # The disk tier
//
// With ServerConfig.Disk the node keeps a disk tier (internal/tier/disk) under its
// pool and does the disk I/O itself, between records and slots; clients
// only see more hits: LookupTiers' count of keys on disk after the pool's
// hits, and BeginLoad's promotions (slots reserved as for a store, records
// read into them). BeginLoad promotes before it answers; BeginLoadTiers
// reports the keys on disk instead, and Promote brings them in a chunk a
// request, served by the client's promoter goroutine in order and in the
// background, so that a client copies one chunk to its GPU while the node
// reads the next (offload.Dial's Load does). The tier is the embedded
// engine's, internal/tiered's Tier: a block the policy evicts is written
// back if its key passes the admission filter (seen at least twice,
// stores and lookups through the node counted; tiered.DiskConfig's
// AdmitAll, AdmitAfter), within its WriteBackBytes of write-backs waiting
// (past it dropped, counted); WriteThrough also writes every block as it
// becomes ready, and WriteBackOnClose has Close write the pool's ready
// blocks not on disk yet (bounded by Server.CloseContext's context), so
// that a restarted node finds them. A block written back from its slot
// keeps the slot "demoting" (kvcache: bytes intact, readable by promotions, never
// handed to a store, its region not releasable) until its write ends: the
// invariant above (no slot handed to a writer while held) covers it. A
// Delete or Clear reaches the records, also those being written.
//
// # Integration
//
// Pool is the interface offload implements against: its embedded engine
// over a kvcache.Cache, and offload.Dial over a Client (see Pool for
// which call maps to which).
package nodepool
