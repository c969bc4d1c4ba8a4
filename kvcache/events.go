package kvcache

// IndexEvent is what Config.OnIndex is told: a block became visible to
// lookups (Ready) or a visible block left the index (not Ready). Slot is the
// block's slot handle for this occupancy (ID and Gen tell two occupancies of
// one key apart); Namespace is the block's. The hook runs under the cache's
// lock, in the order the changes happened, so a consumer that copies the
// event out (to a bounded channel, say) keeps that order.
//
// Evicted marks a removal that is the policy's own eviction, making room
// (not a delete, clear, trim, nor TinyLFU's after-the-fact rejection): the
// block was wanted and is a candidate for a lower tier (Config.Demote is
// asked about it first). Its slot's bytes stay intact until Config.OnFree is
// called with the same Slot (ID and Gen), or, demoted, until the owner calls
// Demoted with it.
type IndexEvent struct {
	Ready     bool
	Evicted   bool
	Key       Key
	Slot      Slot
	Namespace Namespace
}
