package main

import (
	"fmt"

	"github.com/kvoffload/kvoffload/offload"
)

// gpuCache is the serving stack's view of its GPU KV cache: which key each
// block holds, and an exact LRU order over the blocks holding one. The head
// is the most recently used block. Requests touch a prefix from its tail to
// its first block, so a parent is always more recent than its children and
// the set of cached keys stays closed under prefixes.
type gpuCache struct {
	byKey      map[offload.Key]int
	keyOf      []offload.Key
	prev, next []int // LRU links; -1 ends
	head, tail int
	free       []int
}

// victim is a block evicted from the GPU cache, to be stored.
type victim struct {
	id  int
	key offload.Key
}

func newGPUCache(blocks int) *gpuCache {
	c := &gpuCache{byKey: make(map[offload.Key]int, blocks), keyOf: make([]offload.Key, blocks),
		prev: make([]int, blocks), next: make([]int, blocks), head: -1, tail: -1}
	for id := blocks - 1; id >= 0; id-- {
		c.free = append(c.free, id)
	}
	return c
}

func (c *gpuCache) blocks() int { return len(c.keyOf) }

// prefix returns how many leading keys are cached.
func (c *gpuCache) prefix(keys []offload.Key) int {
	for i, k := range keys {
		if _, ok := c.byKey[k]; !ok {
			return i
		}
	}
	return len(keys)
}

func (c *gpuCache) unlink(id int) {
	if p := c.prev[id]; p >= 0 {
		c.next[p] = c.next[id]
	} else {
		c.head = c.next[id]
	}
	if n := c.next[id]; n >= 0 {
		c.prev[n] = c.prev[id]
	} else {
		c.tail = c.prev[id]
	}
}

func (c *gpuCache) pushHead(id int) {
	c.prev[id], c.next[id] = -1, c.head
	if c.head >= 0 {
		c.prev[c.head] = id
	} else {
		c.tail = id
	}
	c.head = id
}

// touchPrefix makes keys (all cached) the most recent, keys[0] first.
func (c *gpuCache) touchPrefix(keys []offload.Key) {
	for i := len(keys) - 1; i >= 0; i-- {
		id := c.byKey[keys[i]]
		c.unlink(id)
		c.pushHead(id)
	}
}

// drop forgets the key held by block id and frees the block.
func (c *gpuCache) drop(id int) {
	c.unlink(id)
	delete(c.byKey, c.keyOf[id])
	c.free = append(c.free, id)
}

// alloc returns n blocks for new keys: free blocks first, then the least
// recently used ones, which are returned as victims (their keys are
// forgotten; the caller stores them before overwriting the blocks). The
// protected most recent blocks are never taken.
func (c *gpuCache) alloc(n, protected int) ([]int, []victim, error) {
	if n+protected > c.blocks() {
		return nil, nil, fmt.Errorf("a request of %d new and %d cached blocks does not fit in %d GPU blocks", n, protected, c.blocks())
	}
	ids := make([]int, 0, n)
	var vs []victim
	for len(ids) < n {
		if k := len(c.free); k > 0 {
			ids = append(ids, c.free[k-1])
			c.free = c.free[:k-1]
			continue
		}
		id := c.tail
		vs = append(vs, victim{id: id, key: c.keyOf[id]})
		c.unlink(id)
		delete(c.byKey, c.keyOf[id])
		ids = append(ids, id)
	}
	return ids, vs, nil
}

// insert records that block id holds key, as the most recent block.
func (c *gpuCache) insert(id int, key offload.Key) {
	c.byKey[key] = id
	c.keyOf[id] = key
	c.pushHead(id)
}
