package kvcache

// IndexEvent is what Config.OnIndex is told: a block became visible to
// lookups (Ready) or a visible block left the index (not Ready). Slot is the
// block's slot handle for this occupancy (ID and Gen tell two occupancies of
// one key apart); Namespace is the block's. The hook runs under the cache's
// lock, in the order the changes happened, so a consumer that copies the
// event out (to a bounded channel, say) keeps that order.
type IndexEvent struct {
	Ready     bool
	Key       Key
	Slot      Slot
	Namespace Namespace
}
